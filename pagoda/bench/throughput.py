"""`pagoda bench throughput`: offline throughput on a seeded chat-like workload, next to the machine's
roofline and (with --compare hf vllm) its peers on the same model and workload in the same run.

Peers: `hf` (HF transformers `generate`, in this venv) and `vllm` (vLLM's CPU build, in its own venv
outside the repository, run as a subprocess on an HF safetensors copy of the model: see vllm_peer.py)."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pagoda.bench.datasets import (
    BenchRequest,
    add_dataset_args,
    max_prefix_hit_rate,
    requests_from_args,
    seed_from_args,
    synthetic_chat_requests,
)
from pagoda.entrypoints.engine_args import add_engine_args, engine_kwargs
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM

BATCH1_PROMPT_LEN = 32
BATCH1_OUTPUT_LEN = 128


@dataclass
class ThroughputResult:
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_median_s: float = 0.0       # all requests arrive at once: time until each one's first token
    prefix_hit_rate: float = 0.0     # prompt tokens served from the prefix cache / prompt tokens
    spec_decode: dict[str, float] | None = None  # speculative decoding counters of the timed run, when it is on

    @property
    def requests_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "requests_s": self.requests_s, "output_tok_s": self.output_tok_s,
                "total_tok_s": self.total_tok_s}


@dataclass
class Batch1Result:
    prompt_len: int
    output_tokens: int
    ttft_s: float            # add_request to the first output token (prefill)
    decode_s: float          # first output token to the last

    @property
    def decode_tok_s(self) -> float:
        return (self.output_tokens - 1) / self.decode_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decode_tok_s": self.decode_tok_s}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)
    add_dataset_args(p)
    p.add_argument("--compare", nargs="+", choices=["hf", "vllm", "no-prefix-cache", "no-spec"], default=[],
                   help="also run these, after pagoda, on the same model and workload and print our ratio "
                        "(no-prefix-cache: pagoda itself with prefix caching off; no-spec: pagoda without "
                        "--speculative-config, i.e. the speedup of speculation)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of the venv with vLLM's CPU build, for --compare vllm (default: the venv "
                        "scripts/install-peers.sh vllm makes in the cache folder, ~/.cache/pagoda/peers/vllm)")
    p.add_argument("--no-roofline", action="store_true", help="skip measuring the machine's matmul rate and bandwidth")
    p.add_argument("--batch1-decode", action="store_true",
                   help=f"also measure batch-1 decode ({BATCH1_PROMPT_LEN}-token prompt, {BATCH1_OUTPUT_LEN} tokens)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON here")
    p.add_argument("--contend", type=int, default=0, metavar="N",
                   help="also run the workload (and --batch1-decode) with N busy processes, one pinned to each of "
                        "the last N cores, and report the shared run beside the quiet one")


def _params(output_len: int) -> SamplingParams:
    # ignore_eos: every engine then produces exactly the tokens asked for.
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_engine(llm: LLM, requests: Sequence[BenchRequest]) -> ThroughputResult:
    """Time one llm.generate over all requests, after a short warm-up generate (cache cold at the start)."""
    llm.generate([requests[0].prompt_token_ids[:16]], _params(4), use_tqdm=False)
    llm.reset_prefix_cache()
    kv_stats = llm.engine.kv.stats
    hits0, queries0 = kv_stats.hits, kv_stats.queries
    speculator = llm.engine.speculator
    if speculator is not None:
        from pagoda.spec_decode.speculator import SpecDecodeStats

        speculator.stats = SpecDecodeStats()  # count the timed run only
    t0 = time.perf_counter()
    # The bar (stderr, redrawn at most every 0.1 s) shows a run of minutes moving.
    outs = llm.generate([r.prompt_token_ids for r in requests], [_params(r.output_len) for r in requests],
                        use_tqdm=True)
    elapsed = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outs]
    short = [(i, n, r.output_len) for i, (n, r) in enumerate(zip(produced, requests)) if n != r.output_len]
    if short:
        raise RuntimeError(f"engine produced other lengths than asked (index, got, asked): {short[:5]}")
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs
                   if o.metrics is not None and o.metrics.first_token_time is not None)
    queries = kv_stats.queries - queries0
    spec = None
    if speculator is not None:
        st = speculator.stats
        spec = {"num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                "num_accepted_tokens": st.num_accepted_tokens, "num_emitted_tokens": st.num_emitted_tokens,
                "acceptance_rate": st.acceptance_rate, "mean_acceptance_length": st.mean_acceptance_length}
    return ThroughputResult(elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests), sum(produced),
                            ttft_median_s=ttfts[len(ttfts) // 2] if ttfts else 0.0,
                            prefix_hit_rate=(kv_stats.hits - hits0) / queries if queries else 0.0, spec_decode=spec)


def run_batch1_decode(llm: LLM, prompt: list[int], output_len: int) -> Batch1Result:
    """Drive the step loop for one request, timing prefill and decode apart."""
    engine = llm.engine
    t0 = time.perf_counter()
    req = engine.add_request(prompt, _params(output_len))
    t_first = None
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != req.request_id:
                continue
            n = len(out.outputs[0].token_ids)
            if t_first is None and n > 0:
                t_first = time.perf_counter()
    t_end = time.perf_counter()
    if t_first is None:
        raise RuntimeError("batch-1 decode produced no tokens")
    return Batch1Result(len(prompt), n, t_first - t0, t_end - t_first)


def kernel_tuning_report(llm: LLM) -> dict[str, Any]:
    """The kernel tuning that chose the model's linear kernels (kernels/tuning.py): one row per layer shape, with
    the candidates' times at each row count, the choice, and how many layers share the shape."""
    engine = llm.engine
    tuner = engine.runner.policy.tuner
    shapes: dict[str, dict[str, Any]] = {}
    for m in engine.runner.model.modules():
        entry = getattr(getattr(m, "matmul", None), "tuning", None)
        if entry is None:
            continue
        row = shapes.get(entry.key)
        if row is None:
            times_us = {n: [round(1e6 * t, 1) for t in ts] for n, ts in entry.times.items()}
            row = shapes[entry.key] = {"shape": entry.key, "layers": 0, "rows": entry.rows, "times_us": times_us,
                                       "scores": entry.scores, "chosen": entry.chosen}
        row["layers"] += 1
    cache = None if tuner is None or tuner.path is None else str(tuner.path)
    return {"mode": engine.config.kernel_tuning, "cache": cache, "shapes": list(shapes.values())}


def _print_tuning(tuning: dict[str, Any]) -> None:
    shapes = tuning["shapes"]
    if tuning["mode"] != "auto" or not shapes:
        print(f"kernel tuning: {tuning['mode']}" + ("" if tuning["mode"] != "auto" else
                                                     ", no layer has a choice of kernels"))
        return
    rows = "/".join(str(r) for r in shapes[0]["rows"])
    print(f"kernel tuning (us at {rows} rows, chosen marked *; cache {tuning['cache']}):")
    for row in shapes:
        cands = ", ".join(f"{name}{'*' if name == row['chosen'] else ''} {'/'.join(f'{t:.0f}' for t in ts)}"
                          for name, ts in row["times_us"].items())
        print(f"  {row['shape'].rsplit(' ', 1)[0]} x{row['layers']}: {cands}")


def _progress(msg: str) -> None:
    """Phase notes on stderr, so a long run shows where it is without mixing into the report."""
    print(msg, file=sys.stderr, flush=True)


def _print_report(report: dict[str, Any]) -> None:
    w, ours = report["workload"], report["pagoda"]
    print(f"== pagoda bench throughput: {report['model']} ({report['dtype']}, {report['threads']} threads, "
          f"CPU kernels {report.get('cpu_kernels', '?')}, "
          f"load average {report['loadavg_1m_at_start']:.1f} at start) ==")
    lengths = (f"prompts {w['input_len_range'][0]}..{w['input_len_range'][1]} " if w["dataset"] == "chat" else "")
    print(f"workload: {w['dataset']}, {w['num_prompts']} requests, {lengths}({w['prompt_tokens']} prompt tokens), "
          f"{w['output_tokens']} output tokens, seed {w['seed']}")
    print(f"pagoda: {ours['elapsed_s']:.2f} s, {ours['requests_s']:.2f} req/s, "
          f"{ours['output_tok_s']:.1f} output tok/s, {ours['total_tok_s']:.1f} total tok/s, "
          f"median TTFT {1000 * ours['ttft_median_s']:.0f} ms")
    spec = ours.get("spec_decode")
    if spec:
        print(f"speculative decoding ({report.get('speculative_config')}): {spec['num_drafts']} verifications, "
              f"{spec['num_draft_tokens']} tokens proposed, {spec['num_accepted_tokens']} accepted "
              f"({100 * spec['acceptance_rate']:.1f}%), {spec['num_emitted_tokens']} emitted; mean acceptance "
              f"length {spec['mean_acceptance_length']:.2f} tokens per verification")
    shared = report.get("pagoda_shared")
    if shared:
        print(f"pagoda with {shared['busy_processes']} core(s) taken by busy processes: {shared['elapsed_s']:.2f} s, "
              f"{shared['output_tok_s']:.1f} output tok/s = {100 * shared['speed_vs_quiet']:.0f}% of quiet")
    print(f"prefix cache: hit rate {100 * ours['prefix_hit_rate']:.1f}% of prompt tokens "
          f"(the workload's best possible: {100 * report['max_prefix_hit_rate']:.1f}%)")
    if "kernel_tuning" in report:
        _print_tuning(report["kernel_tuning"])
    roof = report.get("roofline")
    if roof:
        print(f"roofline: matmul {roof['matmul_flops'] / 1e9:.0f} GFLOP/s, "
              f"read {roof['read_bandwidth'] / 1e9:.1f} GB/s;"
              f" pagoda achieves {ours['achieved_flops'] / 1e9:.1f} GFLOP/s = "
              f"{100 * ours['compute_efficiency']:.1f}% of the matmul roofline")
    b1 = report.get("batch1_decode")
    if b1:
        line = (f"batch-1 decode: {b1['decode_tok_s']:.1f} tok/s ({b1['output_tokens']} tokens after a "
                f"{b1['prompt_len']}-token prompt, TTFT {1000 * b1['ttft_s']:.0f} ms)")
        if "bandwidth_efficiency" in b1:
            line += (f", {b1['weight_bytes'] / 1e6:.0f} MB of weights per step = "
                     f"{100 * b1['bandwidth_efficiency']:.1f}% of the bandwidth roofline")
        print(line)
        b1s = report.get("batch1_decode_shared")
        if b1s:
            print(f"batch-1 decode with {b1s['busy_processes']} core(s) taken: {b1s['decode_tok_s']:.1f} tok/s = "
                  f"{100 * b1s['speed_vs_quiet']:.0f}% of quiet")
    for name, peer in report.get("peers", {}).items():
        line = (f"{name}: {peer['elapsed_s']:.2f} s, {peer['output_tok_s']:.1f} useful output tok/s "
                f"({peer['generated_tokens']} generated); pagoda / {name} = {peer['ratio']:.2f}x")
        if "ttft_median_s" in peer and peer["ttft_median_s"]:
            line += (f"; median TTFT {1000 * peer['ttft_median_s']:.0f} ms "
                     f"(pagoda {peer['ttft_median_s'] / max(ours['ttft_median_s'], 1e-9):.1f}x lower)")
        if "compute_efficiency" in peer:
            line += f"; {name} achieves {100 * peer['compute_efficiency']:.1f}% of the matmul roofline"
        print(line)
        pb1 = peer.get("batch1_decode")
        if pb1:
            line = (f"{name} batch-1 decode: {pb1['decode_tok_s']:.1f} tok/s (TTFT {1000 * pb1['ttft_s']:.0f} ms)")
            if "bandwidth_efficiency" in pb1:
                line += f" = {100 * pb1['bandwidth_efficiency']:.1f}% of the bandwidth roofline"
            if b1:
                line += f"; pagoda / {name} = {b1['decode_tok_s'] / pb1['decode_tok_s']:.2f}x"
            print(line)


def main(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `--help` reads add_arguments without loading torch

    from pagoda import LLM
    from pagoda.bench.roofline import Roofline, decode_weight_bytes, efficiency, measure_roofline, workload_flops

    load_at_start = os.getloadavg()[0]
    if args.dataset == "json-schema":  # its peers here cannot all constrain: the offline A/B has its own command
        raise ValueError("bench throughput: for constrained offline throughput use `pagoda bench structured`; "
                         "--dataset json-schema is for `pagoda bench serve`")
    if "vllm" in (args.compare or []):
        from pagoda.bench.vllm_peer import DEFAULT_VLLM_PYTHON, check_python

        check_python(args.vllm_python or DEFAULT_VLLM_PYTHON)  # fail before minutes of our own run
    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    dtype: torch.dtype = engine.dtype
    requests = requests_from_args(args, engine.tokenizer)
    _progress(f"pagoda: {len(requests)} requests ...")
    ours = run_engine(llm, requests)
    _progress(f"pagoda: done in {ours.elapsed_s:.1f} s")
    # Measured after our run: the GEMM probe's heavy AVX-512 load measurably slowed the run right after it.
    roofline: Roofline | None = None if args.no_roofline else measure_roofline(dtype)
    if roofline is not None:
        _progress(roofline.describe())
    flops = workload_flops(engine.args, [(len(r.prompt_token_ids), r.output_len) for r in requests])
    spec_cfg = engine.config.speculative_config
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "model": engine.files.source,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu_kernels": engine.runner.policy.kernel_set,
        "kernel_tuning": kernel_tuning_report(llm),
        # Other processes on the machine skew every figure; the 1-minute load average flags it.
        "loadavg_1m_at_start": load_at_start,
        "workload": {"dataset": getattr(args, "dataset", "chat"), "num_prompts": len(requests),
                     "input_len_range": list(args.input_len_range),
                     "output_len_range": list(args.output_len_range), "seed": seed_from_args(args),
                     "prompt_tokens": ours.prompt_tokens, "output_tokens": ours.output_tokens,
                     "flops": flops},
        "pagoda": {**ours.to_dict(), "achieved_flops": flops / ours.elapsed_s},
        "speculative_config": None if spec_cfg is None else asdict(spec_cfg),
        # The best any full-block prefix cache could do on this workload, next to what we measured.
        "max_prefix_hit_rate": max_prefix_hit_rate(requests, engine.config.cache.block_size),
    }
    if roofline is not None:
        report["roofline"] = roofline.to_dict()
        report["pagoda"]["compute_efficiency"] = efficiency(flops / ours.elapsed_s, roofline.matmul_flops)
    prompt: list[int] | None = None
    b1 = None
    if args.batch1_decode:
        prompt = synthetic_chat_requests(engine.tokenizer, 1, (BATCH1_PROMPT_LEN,) * 2, (1, 1),
                                         seed=seed_from_args(args))[0].prompt_token_ids
        _progress("pagoda: batch-1 decode ...")
        b1 = run_batch1_decode(llm, prompt, BATCH1_OUTPUT_LEN)
        report["batch1_decode"] = b1.to_dict()
    if args.contend:  # after every quiet run: the quiet figures never follow a shared one
        from pagoda.bench.contention import busy_cores

        with busy_cores(args.contend) as taken:
            _progress(f"pagoda, cores {taken} taken by busy processes: {len(requests)} requests ...")
            shared = run_engine(llm, requests)
            _progress(f"pagoda shared: done in {shared.elapsed_s:.1f} s "
                      f"({ours.elapsed_s / shared.elapsed_s:.2f}x quiet)")
            report["pagoda_shared"] = {**shared.to_dict(), "busy_processes": args.contend,
                                       "speed_vs_quiet": ours.elapsed_s / shared.elapsed_s}
            if b1 is not None and prompt is not None:
                b1_shared = run_batch1_decode(llm, prompt, BATCH1_OUTPUT_LEN)
                report["batch1_decode_shared"] = {**b1_shared.to_dict(), "busy_processes": args.contend,
                                                  "speed_vs_quiet": b1_shared.decode_tok_s / b1.decode_tok_s}
    if b1 is not None:
        if roofline is not None:
            weight_bytes = decode_weight_bytes(engine.args, dtype)
            report["batch1_decode"].update(
                weight_bytes=weight_bytes,
                bandwidth_efficiency=efficiency(weight_bytes * b1.decode_tok_s, roofline.read_bandwidth))

    compare = list(dict.fromkeys(args.compare or []))  # in the order given, once each
    if compare:
        model_path = engine.files.source
        model_args = engine.args
        del llm, engine
        gc.collect()  # free our weights and KV pool before a peer loads its copy
        report["peers"] = {}
    for name in compare:
        if name == "hf":
            from pagoda.bench.hf_peer import run_hf_peer

            _progress(f"hf: {len(requests)} requests in static batches ...")
            peer = run_hf_peer(model_path, requests, dtype).to_dict()
        elif name in ("no-prefix-cache", "no-spec"):
            _progress(f"pagoda with {name}: {len(requests)} requests ...")
            off = {"enable_prefix_caching": False} if name == "no-prefix-cache" else {"speculative_config": None}
            cold = LLM(args.model, **{**engine_kwargs(args), **off})
            peer = {**run_engine(cold, requests).to_dict()}
            peer["generated_tokens"] = peer["output_tokens"]
            del cold
            gc.collect()
        else:
            from pagoda.bench.vllm_peer import DEFAULT_VLLM_PYTHON, check_python, run_vllm_peer

            python = args.vllm_python or DEFAULT_VLLM_PYTHON
            check_python(python)
            _progress(f"vllm: {len(requests)} requests through {python} (engine start-up takes minutes) ...")
            peer = run_vllm_peer(requests, model_path, dtype, python=python,
                                 batch1=prompt is not None, batch1_prompt=prompt, batch1_output_len=BATCH1_OUTPUT_LEN)
            _progress(f"vllm: done in {peer['elapsed_s']:.1f} s (start-up {peer.get('startup_s', 0):.0f} s)")
            if peer.get("useful_output_tokens") != ours.output_tokens:
                raise RuntimeError(f"vLLM produced {peer.get('useful_output_tokens')} output tokens, "
                                   f"pagoda {ours.output_tokens}: not the same workload")
        peer["ratio"] = ours.output_tok_s / peer["output_tok_s"]
        if roofline is not None:
            peer["achieved_flops"] = flops / peer["elapsed_s"]
            peer["compute_efficiency"] = efficiency(flops / peer["elapsed_s"], roofline.matmul_flops)
            if peer.get("batch1_decode"):
                weight_bytes = decode_weight_bytes(model_args, dtype)
                peer["batch1_decode"].update(
                    weight_bytes=weight_bytes,
                    bandwidth_efficiency=efficiency(weight_bytes * peer["batch1_decode"]["decode_tok_s"],
                                                    roofline.read_bandwidth))
        report["peers"][name] = peer

    _print_report(report)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0
