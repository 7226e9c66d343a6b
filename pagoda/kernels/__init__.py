"""Compute kernels (CPU C++ with pure-torch fallbacks).

Import from the submodules, e.g. ``from pagoda.kernels.paged_attention import paged_attention``
(re-exporting that function here would shadow the submodule of the same name).
"""
