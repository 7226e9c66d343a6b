"""llama.cpp as a peer: batch-1 decode, batched decode and perplexity on the same GGUF and token ids.

llama-cpp-python lives in its own venv in the user cache folder (it compiles llama.cpp, ~8 min):
`bash scripts/install-peers.sh llama` installs it there.

`peer_scripts/llama_cpp_batched.py` runs under that venv's python on a JSON job of token ids (so the
workload is exactly Pagoda's) and prints one result line. It drives llama.cpp's C API so that many
sequences share one `llama_decode` per step, as llama.cpp's server does with parallel slots.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagoda.bench.vllm_peer import PeerFailed, PeerUnavailable, parse_result, peer_python

DEFAULT_LLAMA_PYTHON = peer_python("llama")
SCRIPT = Path(__file__).resolve().parent / "peer_scripts" / "llama_cpp_batched.py"
INSTALL_HINT = ("install llama-cpp-python in its own venv: bash scripts/install-peers.sh llama "
                "(docs/benchmarks.md, 'Peers'); or pass --llama-python PATH")


def run_llama_cpp(gguf: str, *, python: str = DEFAULT_LLAMA_PYTHON, threads: int = 2,
                  batch1: tuple[Sequence[int], int] | None = None, batch1_repeats: int = 1,
                  batched: tuple[Sequence[Sequence[int]], Sequence[int]] | None = None,
                  perplexity: tuple[Sequence[Sequence[int]], Sequence[int]] | None = None,
                  timeout_s: float = 3600.0, extra_bufts: bool = True) -> dict[str, Any]:
    """batch1: (prompt ids, output_len), the fastest of batch1_repeats runs; batched: (prompts, output_lens),
    all started at once, greedy, no EOS stop; perplexity: (windows, first scored position per window).
    extra_bufts=False loads the weights without llama.cpp's repacked/AMX buffers (some builds crash in them).
    Returns the script's dict."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise PeerUnavailable(f"llama.cpp peer not found: {python}; {INSTALL_HINT}")
    job: dict[str, Any] = {"gguf": os.path.abspath(gguf), "threads": threads, "extra_bufts": extra_bufts}
    if batch1 is not None:
        job["batch1"] = {"prompt": [int(t) for t in batch1[0]], "output_len": int(batch1[1]),
                         "repeats": int(batch1_repeats)}
    if batched is not None:
        job["batched"] = {"prompts": [[int(t) for t in p] for p in batched[0]],
                          "output_lens": [int(n) for n in batched[1]]}
    if perplexity is not None:
        job["perplexity"] = {"windows": [[int(t) for t in w] for w in perplexity[0]],
                             "score_from": [int(s) for s in perplexity[1]]}
        job["n_ctx"] = max(4096, max(len(w) for w in perplexity[0]) + 16)
    with tempfile.TemporaryDirectory(prefix="pagoda-llama-") as tmp:
        path = os.path.join(tmp, "job.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(job, f)
        try:
            proc = subprocess.run([python, str(SCRIPT), path], cwd=tmp, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as e:
            raise PeerFailed(f"llama.cpp peer timed out after {timeout_s:g} s") from e
    result = parse_result(proc.stdout or "")
    if proc.returncode != 0 or result is None:
        raise PeerFailed(f"llama.cpp peer failed (exit {proc.returncode}): {(proc.stderr or '')[-2000:]}")
    return result
