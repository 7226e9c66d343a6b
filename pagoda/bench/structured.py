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
import sys
import time
from typing import Any

from pagoda.bench.datasets import SCHEMAS, synthetic_chat_requests
from pagoda.entrypoints.engine_args import add_engine_args, engine_kwargs

# Many fixed keys: most of the output is forced text, which jump-forward appends without decoding.
CONTACT_KEYS = ["first_name", "last_name", "street_address", "city_name", "postal_code", "country_name",
                "phone_number", "email_address"]
CONTACT = {"type": "object", "properties": {k: {"type": "string", "maxLength": 12} for k in CONTACT_KEYS},
           "required": CONTACT_KEYS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32],
                   help="max_num_seqs of each pair of runs")
    p.add_argument("--max-tokens", type=int, default=128, help="cap per request")
    p.add_argument("--jump-forward-rounds", type=int, default=3,
                   help="batch-1 requests on the many-keys schema with jump-forward on and off, alternating")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON here")


def _run(llm: Any, prompts: list[list[int]], params: list[Any], what: str) -> tuple[float, list[Any]]:
    print(f"pagoda bench structured: {what}, {len(prompts)} requests ...", file=sys.stderr, flush=True)
    llm.reset_prefix_cache()  # every run prefills its prompts itself
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)  # the bar is on stderr: a long run shows it moves
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
            llm.engine.input_processor.compile_structured(p)  # the timed runs measure decoding, not first compiles
        stats = llm.engine.structured.stats
        steps0, seconds0 = stats.steps, stats.seconds
        t_con, outs = _run(llm, prompts, constrained, f"concurrency {concurrency}, constrained")
        mask_steps, mask_s = stats.steps - steps0, stats.seconds - seconds0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_is_json(o.outputs[0].text) for o in outs)
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        t_free, _ = _run(llm, prompts, free, f"concurrency {concurrency}, unconstrained")
        t_con_again, again = _run(llm, prompts, constrained,  # seeded: the same tokens again
                                  f"concurrency {concurrency}, constrained again")
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
            llm.engine.input_processor.compile_structured(SamplingParams(structured_outputs={"json": new}))
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            manager.compile(SamplingParams(structured_outputs={"json": new}).constraint).result()  # type: ignore[arg-type]
            warm = time.perf_counter() - t0
            report["compile_ms"] = {"new_schema": 1000 * cold, "cached": 1000 * warm}
            print(f"compile: new schema {1000 * cold:.1f} ms, cached {1000 * warm:.3f} ms", flush=True)
        del llm
    if args.jump_forward_rounds:
        report["jump_forward"] = _jump_forward_batch1(args)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _jump_forward_batch1(args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 latency of one greedy many-keys object with jump-forward on and off, alternated per round."""
    from pagoda import LLM, SamplingParams

    engines = {on: LLM(args.model, **{**engine_kwargs(args), "structured_outputs_jump_forward": on})
               for on in (True, False)}
    messages = [{"role": "user", "content": "A contact card as JSON."}]
    params = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs={"json": CONTACT})
    times: dict[bool, list[float]] = {True: [], False: []}
    outs: dict[bool, Any] = {}
    for llm in engines.values():
        llm.chat(messages, params, use_tqdm=False)  # warm-up and compile
    for _ in range(args.jump_forward_rounds):
        for on, llm in engines.items():
            t0 = time.perf_counter()
            outs[on] = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
            times[on].append(time.perf_counter() - t0)
    med = {on: sorted(t)[len(t) // 2] for on, t in times.items()}
    result = {"on_s": med[True], "off_s": med[False], "speedup": med[False] / med[True],
              "tokens_on": len(outs[True].token_ids), "tokens_off": len(outs[False].token_ids),
              "valid_on": _is_json(outs[True].text), "valid_off": _is_json(outs[False].text),
              "same_text": outs[True].text == outs[False].text}
    print(f"jump-forward, batch 1, {len(CONTACT_KEYS)}-key object: on {med[True] * 1000:.0f} ms "
          f"({result['tokens_on']} tokens), off {med[False] * 1000:.0f} ms ({result['tokens_off']} tokens): "
          f"{result['speedup']:.2f}x; same text: {result['same_text']}", flush=True)
    return result


def _is_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
