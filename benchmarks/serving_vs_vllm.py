"""Pagoda's server against vLLM's CPU build, one after the other: `python -m benchmarks.serving_vs_vllm`.

Both serve the embedded SmolLM2 in bf16 (vLLM from its HF copy: pagoda/bench/hf_copy.py) on both cores, and
`pagoda bench serve` sends each the same random workload (`--input-len` tokens in, `--output-len` out,
ignore_eos) at every concurrency of `--concurrency`, `--prompts-per-level` x concurrency requests a level.
Prints output tok/s, median TTFT and TPOT per server and level, and Pagoda's ratio. vLLM comes from the peers
install (`bash scripts/install-peers.sh vllm`); start-up takes it a few minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pagoda.bench.hf_copy import ensure_hf_copy
from pagoda.bench.vllm_peer import peer_python
from pagoda.model.default_model import default_model_path
from tests.e2e.conftest import wait_healthy

PEER_SCRIPT = Path(__file__).resolve().parents[1] / "pagoda" / "bench" / "peer_scripts" / "vllm_serve.py"


def load(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    n = max(concurrency * args.prompts_per_level, 8)
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "serve", "--base-url", url,
           "--input-len-range", str(args.input_len), str(args.input_len), "--output-len-range",
           str(args.output_len), str(args.output_len), "--num-prompts", str(n), "--max-concurrency",
           str(concurrency), "--num-warmups", "2", "--save-result", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    m = json.loads(out.read_text())["metrics"]
    if m["failed"] or m["output_len_mismatches"]:
        raise RuntimeError(f"{url}: {m['failed']} failed, {m['output_len_mismatches']} cut short")
    return {"tok_s": m["output_throughput"], "ttft_ms": m["median_ttft_ms"], "tpot_ms": m["median_tpot_ms"]}


def serve_and_load(name: str, cmd: list[str], env: dict[str, str], url: str, args: argparse.Namespace,
                   tmp: Path) -> dict[int, dict]:
    log = open(tmp / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, lambda: (tmp / f"{name}.log").read_text()[-4000:], args.startup_timeout, 1.0)
        rows = {}
        for c in args.concurrency:
            rows[c] = load(url, c, args, tmp / f"{name}-{c}.json")
            print(name, c, {k: round(v, 1) for k, v in rows[c].items()}, file=sys.stderr, flush=True)
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-level", type=int, default=4)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--skip-vllm", action="store_true")
    args = p.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ours = serve_and_load("pagoda", [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--dtype",
                                         "bfloat16", "--port", str(args.port), "--max-num-seqs", "64",
                                         "--max-model-len", "2048"], {}, url, args, tmp)
        theirs = {} if args.skip_vllm else serve_and_load(
            "vllm", [peer_python("vllm"), str(PEER_SCRIPT), ensure_hf_copy(gguf), "--host", "127.0.0.1", "--port",
                     str(args.port), "--dtype", "bfloat16", "--max-model-len", "2048", "--served-model-name",
                     "SmolLM2-135M-Instruct"], {}, url, args, tmp)
    print("| concurrency | Pagoda tok/s | TTFT | TPOT | vLLM tok/s | TTFT | TPOT | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for c, r in ours.items():
        v = theirs.get(c)
        tail = (f"{v['tok_s']:.1f} | {v['ttft_ms']:.0f} ms | {v['tpot_ms']:.1f} ms | **{r['tok_s'] / v['tok_s']:.2f}x**"
                if v else "- | - | - | -")
        print(f"| {c} | {r['tok_s']:.1f} | {r['ttft_ms']:.0f} ms | {r['tpot_ms']:.1f} ms | {tail} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
