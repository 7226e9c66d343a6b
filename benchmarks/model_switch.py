"""Model switch time: `python -m benchmarks.model_switch [--rounds 3]`.

A multi-model server (`pagoda serve --model A --model B`) answers its first request to a model it has not loaded
yet by loading it. That first request's latency is set against the same model's cold start as a server of its own
(from launching the process to the answer of the same request), alternated `--rounds` times, each round with
fresh servers. A is the embedded SmolLM2 GGUF and B its HF copy (safetensors), so both are real models on disk.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import wait_healthy

REPO = Path(__file__).resolve().parents[1]


def _serve(args: list[str], port: int, log: Path, dtype: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--kv-cache-memory", "256MiB", "--max-model-len", "1024", *args]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _ask(url: str, model: str) -> float:
    """Seconds for one 16-token greedy completion."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _model_ids(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def switch_once(a: str, b: str, port: int, log: Path, dtype: str) -> tuple[float, float]:
    """(first request to B, loading it; the next request to B) in a server serving A and B, A warm."""
    url = f"http://127.0.0.1:{port}"
    proc = _serve(["--model", a, "--model", b], port, log, dtype)
    try:
        wait_healthy(url, proc, lambda: log.read_text()[-3000:], 600, 0.05)
        name_a, name_b = _model_ids(url)
        _ask(url, name_a)  # the process is warm: its first model loaded and answered
        first = _ask(url, name_b)
        return first, _ask(url, name_b)
    finally:
        _stop(proc)


def cold_once(b: str, port: int, log: Path, dtype: str) -> float:
    """From launching a server of B alone to its answer of the same request."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = _serve(["--model", b], port, log, dtype)
    try:
        wait_healthy(url, proc, lambda: log.read_text()[-3000:], 600, 0.05)
        _ask(url, _model_ids(url)[0])
        return time.perf_counter() - t0
    finally:
        _stop(proc)


def main(argv: list[str] | None = None) -> int:
    from pagoda.bench.hf_copy import ensure_hf_copy
    from pagoda.model.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=18437)
    args = p.parse_args(argv)
    a = str(default_model_path())
    b = ensure_hf_copy(a)
    switches, warms, colds = [], [], []
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "serve.log"
        for _ in range(args.rounds):
            first, warm = switch_once(a, b, args.port, log, args.dtype)
            cold = cold_once(b, args.port, log, args.dtype)
            switches.append(first)
            warms.append(warm)
            colds.append(cold)
            print(f"first request to an unloaded model {first:.2f} s (then {warm:.2f} s); "
                  f"cold start of a server of it {cold:.2f} s", file=sys.stderr, flush=True)
    s, w, c = statistics.median(switches), statistics.median(warms), statistics.median(colds)
    print(f"model switch: {s:.2f} s for the first request to an unloaded model (warm request {w:.2f} s); cold start "
          f"as its own server {c:.2f} s; switch / cold start {s / c:.2f}x (medians of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
