"""The C++ CPU kernels compiled when the package was built (setup.py), one library per build and key
(kernels/build_spec.py); kernels/cpu_extension.py loads the one that matches this machine. Empty in a source
checkout that was not installed: the kernels then compile on first use."""
