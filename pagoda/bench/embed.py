"""`pagoda bench embed`: an embedding model in Pagoda and in sentence-transformers (torch), in one process on the
same threads, alternating runs so both see the same machine: throughput over N sentences at one batch size, and
batch-1 latency, with the ratios. Sentences are windows of the benchmark corpus (bench/corpus/GPL-3) of
log-uniform token lengths, decoded back to text, so each side tokenizes them itself."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagoda.bench.datasets import CORPUS_PATH, load_corpus, log_uniform_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a sentence-transformers folder (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("--num-sentences", type=int, default=1000, help="sentences in each throughput run")
    p.add_argument("--min-tokens", type=int, default=8, help="shortest sentence, in tokens with the specials")
    p.add_argument("--max-tokens", type=int, default=256, help="longest sentence, in tokens with the specials")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward in the throughput runs")
    p.add_argument("--rounds", type=int, default=3, help="throughput runs per side, alternating")
    p.add_argument("--latency-samples", type=int, default=100,
                   help="batch-1 requests per side, alternating one by one")
    p.add_argument("--dtype", default="float32", help="Pagoda's compute dtype (sentence-transformers runs fp32)")
    p.add_argument("--threads", type=int, default=None, help="compute threads of both (default: Pagoda's choice)")
    p.add_argument("--cpus", default=None, help="cores both run on, e.g. 0-7 (default: this process's)")
    p.add_argument("--corpus", default=str(CORPUS_PATH), help="text the sentences are cut from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON here")


@dataclass
class SideResult:
    name: str
    sentences_per_s: list[float]   # one per throughput round
    latency_ms: list[float]        # one per batch-1 request

    @property
    def best_sentences_per_s(self) -> float:
        return max(self.sentences_per_s)

    @property
    def median_latency_ms(self) -> float:
        return statistics.median(self.latency_ms)

    @property
    def p90_latency_ms(self) -> float:
        return sorted(self.latency_ms)[int(0.9 * (len(self.latency_ms) - 1))]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "best_sentences_per_s": self.best_sentences_per_s,
                "median_latency_ms": self.median_latency_ms, "p90_latency_ms": self.p90_latency_ms}


def sentences(tokenizer: Any, n: int, lo: int, hi: int, seed: int, corpus_path: str) -> list[str]:
    """`n` corpus windows of log-uniform length in [lo, hi] tokens counting the model's special tokens."""
    specials = tokenizer.num_special_tokens_to_add(is_pair=False)
    corpus = tokenizer.encode(load_corpus(corpus_path), add_special_tokens=False).ids
    lo, hi = max(1, lo - specials), max(1, hi - specials)
    if len(corpus) < hi:
        raise ValueError(f"{corpus_path}: {len(corpus)} tokens, fewer than the longest sentence ({hi})")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = log_uniform_int(rng, lo, hi)
        start = rng.randrange(len(corpus) - length + 1)
        out.append(tokenizer.decode(corpus[start:start + length]))
    return out


def main(args: argparse.Namespace) -> int:
    import torch

    from pagoda.config import PoolingConfig
    from pagoda.executor.pooling_runner import PoolingRunner

    for name in ("num_sentences", "batch_size", "rounds", "latency_samples", "min_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < args.min_tokens:
        raise ValueError("--max-tokens must be at least --min-tokens")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("pagoda bench embed: sentence-transformers is not installed (pip install sentence-transformers)",
              file=sys.stderr)
        return 1
    config = PoolingConfig.from_kwargs(args.model, dtype=args.dtype, threads=args.threads, cpus=args.cpus,
                                       max_num_seqs=args.batch_size)
    runner = PoolingRunner.from_config(config)  # pins the cores and threads both sides then run on
    if runner.is_cross_encoder:
        raise ValueError(f"{runner.folder} is a cross-encoder; bench embed measures embedding models")
    st = SentenceTransformer(runner.folder, device="cpu")
    st.max_seq_length = runner.max_model_len
    texts = sentences(runner.tokenizer, args.num_sentences, args.min_tokens, min(args.max_tokens,
                      runner.max_model_len), args.seed, args.corpus)
    print(f"pagoda bench embed: {runner.folder}, {len(texts)} sentences of {args.min_tokens}-{args.max_tokens} "
          f"tokens, {torch.get_num_threads()} threads, Pagoda {runner.dtype} vs sentence-transformers fp32",
          file=sys.stderr, flush=True)

    def pagoda_embed(batch: list[str]) -> torch.Tensor:
        return torch.stack(runner.run([runner.tokenize(t, truncate=-1) for t in batch]))

    def st_embed(batch: list[str]) -> torch.Tensor:
        return st.encode(batch, batch_size=args.batch_size, convert_to_tensor=True)

    # Warm both (first-call allocations, lazy inits) and check they compute the same vectors.
    check = texts[:args.batch_size]
    cos = torch.nn.functional.cosine_similarity(pagoda_embed(check), st_embed(check).float()).min().item()
    sides = {"pagoda": SideResult("pagoda", [], []), "sentence-transformers": SideResult("sentence-transformers",
                                                                                         [], [])}
    for r in range(args.rounds):
        for name, one_batch in (("pagoda", pagoda_embed), ("sentence-transformers", None)):
            t0 = time.perf_counter()
            if one_batch is None:
                st_embed(texts)  # sentence-transformers' own batching (it sorts by length first)
            else:
                for i in range(0, len(texts), args.batch_size):
                    one_batch(texts[i:i + args.batch_size])
            rate = len(texts) / (time.perf_counter() - t0)
            sides[name].sentences_per_s.append(rate)
            print(f"  round {r + 1} {name}: {rate:.1f} sentences/s", file=sys.stderr, flush=True)
    rng = random.Random(args.seed + 1)
    for _ in range(args.latency_samples):
        text = texts[rng.randrange(len(texts))]
        for name, fn in (("pagoda", pagoda_embed), ("sentence-transformers", st_embed)):
            t0 = time.perf_counter()
            fn([text])
            sides[name].latency_ms.append((time.perf_counter() - t0) * 1000)
    p, s = sides["pagoda"], sides["sentence-transformers"]
    print(f"{'':24}{'sentences/s (best)':>20}{'batch-1 p50 ms':>16}{'batch-1 p90 ms':>16}")
    for side in (p, s):
        print(f"{side.name:24}{side.best_sentences_per_s:>20.1f}{side.median_latency_ms:>16.2f}"
              f"{side.p90_latency_ms:>16.2f}")
    throughput_ratio = p.best_sentences_per_s / s.best_sentences_per_s
    latency_ratio = p.median_latency_ms / s.median_latency_ms
    print(f"throughput at batch {args.batch_size}: Pagoda {throughput_ratio:.2f}x sentence-transformers; "
          f"batch-1 p50 latency: Pagoda {latency_ratio:.2f}x sentence-transformers'; lowest cosine "
          f"{cos:.6f}")
    if args.output_json:
        report = {"model": runner.folder, "num_sentences": len(texts), "batch_size": args.batch_size,
                  "threads": torch.get_num_threads(), "dtype": str(runner.dtype), "min_cosine": cos,
                  "throughput_ratio": throughput_ratio, "latency_ratio": latency_ratio,
                  "sides": [p.to_dict(), s.to_dict()]}
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0
