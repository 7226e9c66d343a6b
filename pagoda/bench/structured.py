"""`pagoda bench structured`: what a JSON schema per request costs, side by side with the same work unconstrained.

Each request asks for an object under one of several distinct schemas (sampled at temperature 0.8). The
constrained run goes first; the unconstrained run then generates exactly as many tokens per request
(`ignore_eos`), so the two runs do the same model work and their output tok/s compare directly. Both run at
each `--concurrency` (the engine's max_num_seqs). Also reported: the mask time per step, and the time to
compile a new schema against a cached one.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagoda.bench.datasets import synthetic_chat_requests
from pagoda.entrypoints.cli import add_engine_args, engine_kwargs

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32}}, "required": ["name", "age", "email"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"type": "string",
                                                                                          "maxLength": 12},
                                                            "minItems": 1, "maxItems": 4},
        "rating": {"enum": [1, 2, 3, 4, 5]}}, "required": ["title", "tags", "rating"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer"}, "coastal": {"type": "boolean"}},
     "required": ["city", "country", "population", "coastal"]},
    {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 10},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3}}, "required": ["order_id", "items"]},
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32],
                   help="max_num_seqs of each pair of runs")
    p.add_argument("--max-tokens", type=int, default=128, help="cap per request")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON here")


def _run(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[Any]]:
    llm.reset_prefix_cache()  # every run prefills its prompts itself
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def main(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    report: dict[str, Any] = {"num_prompts": args.num_prompts, "num_schemas": len(SCHEMAS), "runs": []}
    for concurrency in args.concurrency:
        llm = LLM(args.model, **{**engine_kwargs(args), "max_num_seqs": concurrency})
        prompts = [r.prompt_token_ids for r in synthetic_chat_requests(
            llm.engine.tokenizer, args.num_prompts, (16, 64), (1, 1), seed=0)]
        constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                                      structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]})
                       for i in range(len(prompts))]
        llm.generate(prompts[:2], constrained[:len(SCHEMAS)][:2], use_tqdm=False)  # warm-up: kernels, backend
        for p in constrained[:len(SCHEMAS)]:
            llm.engine.compile_structured(p)  # the timed runs measure decoding, not first compiles
        stats = llm.engine.structured.stats
        steps0, seconds0 = stats.steps, stats.seconds
        t_con, outs = _run(llm, prompts, constrained)
        mask_steps, mask_s = stats.steps - steps0, stats.seconds - seconds0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_is_json(o.outputs[0].text) for o in outs)
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        t_free, _ = _run(llm, prompts, free)
        t_con_again, again = _run(llm, prompts, constrained)  # seeded: the same tokens again
        assert [len(o.outputs[0].token_ids) for o in again] == lengths
        t_con = (t_con + t_con_again) / 2  # constrained runs on both sides of the unconstrained one
        tokens = sum(lengths)
        run = {"concurrency": concurrency, "output_tokens": tokens, "valid_json": valid,
               "constrained_tok_s": tokens / t_con, "unconstrained_tok_s": tokens / t_free,
               "ratio": t_free / t_con, "mask_ms_per_step": 1000 * mask_s / max(1, mask_steps),
               "mask_share": mask_s / t_con}
        report["runs"].append(run)
        print(f"concurrency {concurrency}: {tokens} tokens, {valid}/{len(outs)} valid JSON; constrained "
              f"{run['constrained_tok_s']:.1f} tok/s, unconstrained {run['unconstrained_tok_s']:.1f} tok/s: "
              f"{run['ratio']:.2f}x; mask {run['mask_ms_per_step']:.2f} ms per step "
              f"({100 * run['mask_share']:.1f}% of the run)", flush=True)
        if concurrency == args.concurrency[-1]:
            manager = llm.engine.structured
            new = {**SCHEMAS[0], "title": f"fresh-{time.time_ns()}"}  # a schema text never compiled before
            t0 = time.perf_counter()
            llm.engine.compile_structured(SamplingParams(structured_outputs={"json": new}))
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            manager.compile(SamplingParams(structured_outputs={"json": new}).constraint).result()  # type: ignore[arg-type]
            warm = time.perf_counter() - t0
            report["compile_ms"] = {"new_schema": 1000 * cold, "cached": 1000 * warm}
            print(f"compile: new schema {1000 * cold:.1f} ms, cached {1000 * warm:.3f} ms", flush=True)
        del llm
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _is_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
