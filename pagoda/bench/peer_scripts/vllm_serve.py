"""vLLM's OpenAI-compatible server, run by the vLLM venv's python (not pagoda's): the serving peer of
`pagoda bench serve`. Standalone on purpose: it imports nothing from pagoda.

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        ~/.cache/pagoda/peers/vllm/bin/python vllm_serve.py HF_FOLDER --host 127.0.0.1 --port 8001 [vllm flags]

`vllm-cpu` installs vLLM under another distribution name, so the `vllm` command's version lookup finds no
package "vllm" and fails (shared/PEERS.md); this wrapper answers that lookup with vllm-cpu's version and
then runs `vllm serve` with the given arguments. Make an HF folder of the embedded GGUF with
`python -c "from pagoda.bench.hf_copy import ensure_hf_copy; print(ensure_hf_copy(GGUF))"`.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

DEFAULT_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def main() -> None:
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return real_version("vllm-cpu")
        return real_version(name)

    importlib.metadata.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
