"""MoE decode against dense models: `python -m benchmarks.moe_decode`.

Three random-weight models with Mixtral's shape ratios (expert intermediate 3.5 x hidden, 8 experts, top 2):
the MoE model, a dense Llama with the same total parameters (one MLP of 8 experts' width) and one with the same
active parameters (an MLP of 2 experts' width). Decode tokens/s at batch 1 and with 16 requests at once, and the
weight bytes a decode step reads: attention, router and the experts the step's tokens chose (counted by
wrapping the experts op in an untimed run), against the dense models' whole weights.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams
from pagoda.model.default_model import default_model_path

PROMPT_LEN, DECODE = 32, 64


def build(path: Path, kind: str, hidden: int, inter: int, experts: int, top_k: int, layers: int) -> tuple[int, int]:
    """Save a random-weight HF model folder, kind "moe" (Mixtral), "dense-total" or "dense-active" (Llama), at
    `path`; returns its total and active (per token) parameter counts."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=8192, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 256), max_position_embeddings=1024, initializer_range=0.02,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "moe":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                                 num_experts_per_tok=top_k, **common))
    else:
        width = inter * (experts if kind == "dense-total" else top_k)
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=width, **common))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    total = sum(p.numel() for p in model.parameters())
    idle = (experts - top_k) * 3 * hidden * inter * layers if kind == "moe" else 0
    return total, total - idle


def decode_rate(llm: LLM, batch: int, repeats: int = 5) -> float:
    """Decode tokens/s with `batch` requests at once: the step loop timed from the step that gives every request
    its first token (the prefill) to the last; the best of `repeats` runs (other jobs may share the machine)."""
    engine = llm.engine
    best = 0.0
    for r in range(repeats + 1):  # the first run warms up
        for b in range(batch):
            engine.add_request([(7 * i + 13 * b + r) % 8000 + 3 for i in range(PROMPT_LEN)],
                               SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True))
        counts: dict[str, int] = {}
        t_first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                counts[out.request_id] = len(out.outputs[0].token_ids)
            if t_first is None and len(counts) == batch and all(counts.values()):
                t_first, first = time.perf_counter(), sum(counts.values())
        rate = (sum(counts.values()) - first) / (time.perf_counter() - t_first)
        best = max(best, rate) if r else best
    return best


def step_bytes(llm: LLM, batch: int) -> float:
    """Weight bytes one decode step reads on average (an untimed run counting the experts each step chose)."""
    from pagoda.layers.linear import Linear
    from pagoda.layers.moe import ExpertsOp, SparseMoeBlock

    model = llm.engine.runner.model

    def nbytes(lin: Linear) -> int:
        return lin.qweight.nbytes if lin.qweight is not None else lin.weight.numel() * lin.weight.element_size()

    fixed = sum(nbytes(m) for m in model.modules() if isinstance(m, Linear))  # the LM head included
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if not blocks:
        return float(fixed)
    expert_bytes = nbytes(blocks[0].experts[0].gate_up_proj) + nbytes(blocks[0].experts[0].down_proj)
    fixed -= sum(expert_bytes * len(b.experts) for b in blocks)
    fixed += sum(b.gate.weight.numel() * b.gate.weight.element_size() for b in blocks)
    chosen: list[int] = []
    call = ExpertsOp.__call__

    def counting(self: ExpertsOp, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == batch:  # decode steps only
            chosen.append(int(ids.unique().numel()))
        return call(self, x, ids, weights)

    ExpertsOp.__call__ = counting  # type: ignore[method-assign]
    try:
        prompts = [[(7 * i + 13 * b) % 8000 + 3 for i in range(PROMPT_LEN)] for b in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        ExpertsOp.__call__ = call  # type: ignore[method-assign]
    per_layer = sum(chosen) / len(chosen)
    return fixed + per_layer * len(blocks) * expert_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=2688, help="3.5 x hidden, as Mixtral")
    p.add_argument("--quantization", default=None, help="int8 / int4: quantize every model's linears")
    p.add_argument("--batches", default="1,16")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("moe", "dense-total", "dense-active"):
            path = Path(tmp) / kind
            total, active = build(path, kind, args.hidden, args.expert_intermediate, args.experts, args.top_k,
                                  args.layers)
            llm = LLM(str(path), tokenizer=default_model_path(), dtype="bfloat16", quantization=args.quantization,
                      kv_cache_memory="256MiB")
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append({"model": kind, "params_M": total / 1e6, "active_M": active / 1e6, "batch": batch,
                             "decode_tok_s": decode_rate(llm, batch), "step_MB": step_bytes(llm, batch) / 1e6})
                print(json.dumps(rows[-1]), flush=True)
            del llm
    print("| model | params (M) | active (M) | batch | decode tok/s | weight MB read per decode step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params_M']:.0f} | {r['active_M']:.0f} | {r['batch']} | "
              f"{r['decode_tok_s']:.1f} | {r['step_MB']:.0f} |")


if __name__ == "__main__":
    main()
