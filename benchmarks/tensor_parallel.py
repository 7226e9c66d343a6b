"""Tensor parallelism on this machine: TP=2 (two ranks, each on its share of the cores) against TP=1 (one process
on all of them), decode tokens/s at each concurrency, alternated process by process (A B A B ...) so the ratio
holds while the machine drifts; with the collectives' time per step on rank 0 and the projection for a machine
whose ranks each have their own memory bandwidth (a 2-socket server, one rank per socket):

    python -m benchmarks.tensor_parallel [--model M] [--dtype bfloat16] [--concurrency 1 32] [--pairs 3]

Rank 0's time in the collectives includes waiting for the slower rank (the embedded model's 9 heads split 6 + 3).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPT = list(range(100, 132))


def run_one(tp: int, model: str | None, dtype: str, concurrency: int, tokens: int) -> dict[str, float]:
    """One configuration in this process: best of three timed rounds after a warm-up."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, tensor_parallel_size=tp, kv_cache_memory="512MiB",
              max_num_seqs=max(concurrency, 1))
    if tp == 1:
        from pagoda.executor.multiproc import bind_cores

        bind_cores(0, 1)  # a compute thread on every core this process may use (TP=2 binds each rank to its share)
    comm_s, calls = [0.0], [0]
    if tp > 1:  # time rank 0's collectives: the modules call comm.all_reduce / all_gather through the instance
        comm = llm.engine.runner.comm
        for name in ("all_reduce", "all_gather"):
            inner = getattr(comm, name)

            def timed(t, _inner=inner):  # noqa: ANN001, ANN202
                t0 = time.perf_counter()
                out = _inner(t)
                comm_s[0] += time.perf_counter() - t0
                calls[0] += 1
                return out

            setattr(comm, name, timed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [PROMPT[i % 7:] + [i] for i in range(concurrency)]
    llm.generate(prompts, params, use_tqdm=False)
    best = {"tok_s": 0.0}
    for _ in range(3):
        comm_s[0], calls[0] = 0.0, 0
        steps0 = llm.engine.stats.num_scheduled_tokens
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rate = concurrency * tokens / dt
        if rate > best["tok_s"]:
            steps = tokens + 1  # one prefill step and `tokens - 1` decode steps, roughly, per round
            best = {"tok_s": rate, "step_ms": 1e3 * dt / steps, "comm_ms": 1e3 * comm_s[0] / steps,
                    "calls": calls[0] / steps, "tokens": llm.engine.stats.num_scheduled_tokens - steps0}
    llm.close()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: run TP=N, print JSON
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.model, args.dtype, args.concurrency[0], args.tokens)))
        return
    print(f"| concurrency | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 (median of {args.pairs} pairs) | TP=2 step ms | "
          "collectives ms/step (calls) | projected TP=2 / TP=1, a rank per socket |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for _ in range(args.pairs):
            for tp in (1, 2):
                cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--one", str(tp), "--dtype", args.dtype,
                       "--concurrency", str(c), "--tokens", str(args.tokens)] + \
                      (["--model", args.model] if args.model else [])
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[tp].append(json.loads(out.strip().splitlines()[-1]))
        ratio = statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(runs[1], runs[2]))
        one, two = (statistics.median(r["tok_s"] for r in runs[tp]) for tp in (1, 2))
        step2 = statistics.median(r["step_ms"] for r in runs[2])
        comm = statistics.median(r["comm_ms"] for r in runs[2])
        calls = statistics.median(r["calls"] for r in runs[2])
        step1 = statistics.median(r["step_ms"] for r in runs[1])
        # A rank per socket reads half the weights from its own memory: the step's compute and bandwidth halve,
        # the collectives are added (rank 0's measured time, waiting included: an upper bound).
        projected = step1 / (step1 / 2 + comm)
        print(f"| {c} | {one:,.1f} | {two:,.1f} | {ratio:.2f} | {step2:.2f} | {comm:.2f} ({calls:.0f}) | "
              f"{projected:.2f} |")


if __name__ == "__main__":
    main()
