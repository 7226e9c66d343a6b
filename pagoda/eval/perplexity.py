"""`pagoda eval perplexity [MODEL] --text FILE`: sliding-window perplexity through Pagoda's engine.

The method of Hugging Face's perplexity guide: windows of `max_length` tokens start every `stride`
tokens; in each window only the tokens no earlier window scored count (the first window scores all
but its first token), so every scored token has at least max_length - stride tokens of context once
the first window is past. PPL = exp(sum of their negative log-likelihoods / their count).
The windows run as prompts with prompt_logprobs=0 (the log-probability of each actual prompt token)
and max_tokens=1, so whatever the engine applies (dtype, --quantization, a quantized checkpoint)
is what gets measured.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Window:
    begin: int
    end: int
    num_scored: int  # the last num_scored tokens of [begin, end) are scored (never the window's first)


def sliding_windows(num_tokens: int, max_length: int = 512, stride: int = 256) -> list[Window]:
    if max_length < 2 or not 0 < stride <= max_length:
        raise ValueError(f"need max_length >= 2 and 0 < stride <= max_length, got {max_length}, {stride}")
    if num_tokens < 2:
        raise ValueError("the text has fewer than 2 tokens")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        out.append(Window(begin, end, min(end - prev_end, end - begin - 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


@dataclass
class PerplexityResult:
    perplexity: float
    nll_sum: float
    num_scored: int
    num_windows: int
    tokens_processed: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_processed / self.seconds if self.seconds > 0 else float("inf")


def perplexity(llm: Any, token_ids: list[int], max_length: int = 512, stride: int = 256,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of `token_ids` under a pagoda LLM (all windows submitted as one batch); `progress`: a bar on
    stderr as windows finish."""
    from pagoda import SamplingParams

    windows = sliding_windows(len(token_ids), max_length, stride)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": token_ids[w.begin:w.end]} for w in windows]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - t0
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        length = w.end - w.begin
        lps = out.prompt_logprobs
        if lps is None or out.outputs[0].finish_reason == "error":
            raise RuntimeError(f"perplexity: the engine failed window {w.begin}..{w.end} (see the log)")
        for j in range(length - w.num_scored, length):
            tok = token_ids[w.begin + j]
            nll -= lps[j][tok].logprob
            count += 1
    return PerplexityResult(math.exp(nll / count), nll, count, len(windows),
                            sum(w.end - w.begin for w in windows), seconds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagoda.entrypoints.engine_args import add_engine_args

    p.add_argument("model", nargs="?", default=None,
                   help="HF folder, INT4 checkpoint folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--text", required=True, help="a text file, e.g. pagoda/bench/corpus/GPL-3")
    p.add_argument("--max-length", type=int, default=512, help="tokens per window")
    p.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    p.add_argument("--max-text-tokens", type=int, default=None, help="only the first N tokens of the text")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(p, decoding=False)  # it scores text: no speculation, no grammar


def main(args: argparse.Namespace) -> int:
    from pagoda import LLM
    from pagoda.entrypoints.engine_args import engine_kwargs

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_model_len", max(args.max_length + 1, 64))
    llm = LLM(args.model, **kwargs)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    if args.max_text_tokens:
        ids = ids[: args.max_text_tokens]
    print(f"pagoda eval perplexity: {len(ids)} tokens in windows of {args.max_length} ...", file=sys.stderr,
          flush=True)
    res = perplexity(llm, ids, args.max_length, args.stride, progress=True)
    if args.json:
        print(json.dumps({**asdict(res), "tokens_per_s": res.tokens_per_s, "model": args.model or "default",
                          "text": args.text, "max_length": args.max_length, "stride": args.stride,
                          "dtype": args.dtype, "quantization": args.quantization}))
    else:
        print(f"perplexity {res.perplexity:.4f} over {res.num_scored} tokens ({res.num_windows} windows of "
              f"<= {args.max_length}, stride {args.stride}); {res.tokens_per_s:.0f} tokens/s")
    return 0
