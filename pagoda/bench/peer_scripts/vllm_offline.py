"""vLLM's offline throughput on a pagoda workload, run by the vLLM venv's python (not pagoda's).

Standalone on purpose: it imports nothing from pagoda, since the peer's venv does not have it.

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        ~/.cache/pagoda/peers/vllm/bin/python vllm_offline.py WORKLOAD.json [--result RESULT.json]

WORKLOAD.json: {"model": HF folder, "dtype": "bfloat16" | "float32", "max_model_len": int,
                "requests": [{"prompt_token_ids": [int, ...], "output_len": int}, ...],
                "batch1": null | {"prompt_token_ids": [...], "output_len": int},
                "engine_kwargs": {...}  (optional, passed to vllm.LLM)}

It builds `vllm.LLM`, runs a short warm-up, then times one `generate` over every request (greedy,
ignore_eos, max_tokens = output_len) and checks each request got exactly its output_len tokens. With
"batch1", it also times one request alone: a 1-token generate (the prefill, i.e. TTFT) and a full one;
decode tok/s = (output_len - 1) / (t_full - t_1). The result is one JSON line on stdout, prefixed with
RESULT_PREFIX (vLLM logs to stdout too), and also written to --result when given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

RESULT_PREFIX = "PAGODA_PEER_RESULT "
WORKLOAD_VERSION = 1
# The recipe in shared/PEERS.md: CPU build, 4 GiB KV cache, both cores bound (the default leaves one idle).
DEFAULT_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def load_workload(path: str) -> dict[str, Any]:
    """Read and check a workload file; raises ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        w = json.load(f)
    if not isinstance(w, dict):
        raise ValueError("workload must be a JSON object")
    if w.get("version", WORKLOAD_VERSION) != WORKLOAD_VERSION:
        raise ValueError(f"workload version {w.get('version')} is not {WORKLOAD_VERSION}")
    for key in ("model", "dtype", "requests"):
        if key not in w:
            raise ValueError(f"workload lacks {key!r}")
    reqs = w["requests"]
    if not isinstance(reqs, list) or not reqs:
        raise ValueError("workload 'requests' must be a non-empty list")
    for i, r in enumerate(reqs + ([w["batch1"]] if w.get("batch1") else [])):
        ids, n = r.get("prompt_token_ids"), r.get("output_len")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"request {i}: prompt_token_ids must be a non-empty list of ints")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"request {i}: output_len must be a positive int")
    if "max_model_len" not in w or w["max_model_len"] is None:
        w["max_model_len"] = max(len(r["prompt_token_ids"]) + r["output_len"] for r in reqs)
    return w


def _params(vllm: Any, n: int) -> Any:
    return vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _generate(vllm: Any, llm: Any, reqs: list[dict[str, Any]]) -> list[int]:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    outs = llm.generate(prompts, [_params(vllm, r["output_len"]) for r in reqs], use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


def run(w: dict[str, Any]) -> dict[str, Any]:
    for k, v in DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(model=w["model"], dtype=w["dtype"], max_model_len=int(w["max_model_len"]), seed=0,
                   **(w.get("engine_kwargs") or {}))
    startup_s = time.perf_counter() - t0
    reqs = w["requests"]
    # Warm-up: a short generate settles lazy initialisation and compiled graphs for small batches.
    _generate(vllm, llm, [{"prompt_token_ids": reqs[0]["prompt_token_ids"][:16], "output_len": 4}] * 2)
    t0 = time.perf_counter()
    produced = _generate(vllm, llm, reqs)
    elapsed = time.perf_counter() - t0
    short = [(i, n, r["output_len"]) for i, (n, r) in enumerate(zip(produced, reqs)) if n != r["output_len"]]
    if short:
        raise RuntimeError(f"vLLM produced other lengths than asked (index, got, asked): {short[:5]}")
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    out_tokens = sum(produced)
    result: dict[str, Any] = {
        "name": f"vllm {getattr(vllm, '__version__', '?')} {w['dtype']}",
        "version": getattr(vllm, "__version__", None),
        "dtype": w["dtype"],
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "num_requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "useful_output_tokens": out_tokens,
        "generated_tokens": out_tokens,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (prompt_tokens + out_tokens) / elapsed,
        "requests_s": len(reqs) / elapsed,
        "env": {k: os.environ.get(k) for k in DEFAULT_ENV},
    }
    b1 = w.get("batch1")
    if b1:
        one = [{"prompt_token_ids": b1["prompt_token_ids"], "output_len": 1}]
        full = [dict(b1)]
        _generate(vllm, llm, full)  # warm-up at batch 1
        ttft = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            _generate(vllm, llm, one)
            ttft = min(ttft, time.perf_counter() - t0)
        t0 = time.perf_counter()
        n = _generate(vllm, llm, full)[0]
        t_full = time.perf_counter() - t0
        if n != b1["output_len"]:
            raise RuntimeError(f"vLLM batch-1 produced {n} tokens, asked {b1['output_len']}")
        decode_s = max(t_full - ttft, 1e-9)
        result["batch1_decode"] = {"prompt_len": len(b1["prompt_token_ids"]), "output_tokens": n,
                                   "ttft_s": ttft, "decode_s": decode_s, "decode_tok_s": (n - 1) / decode_s}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", help="workload JSON file")
    p.add_argument("--result", default=None, help="also write the result JSON here")
    args = p.parse_args(argv)
    result = run(load_workload(args.workload))
    line = json.dumps(result)
    if args.result:
        tmp = args.result + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line)
        os.replace(tmp, args.result)
    print(RESULT_PREFIX + line, flush=True)
    return 0


if __name__ == "__main__":  # required: vLLM's engine core starts in a spawned process
    sys.exit(main())
