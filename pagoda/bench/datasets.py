"""Benchmark workloads: a seeded, synthetic chat-like set of requests over real English text.

Each request is a prompt of token ids cut from the GNU GPL-3 text (a fixed, freely available English
corpus on Debian machines) at a seeded offset, plus the number of tokens to generate.

Lengths are log-uniform over their ranges: ln(length) is uniform between ln(lo) and ln(hi). That
skews towards short requests with a long tail, as chat traffic does. With the defaults (prompts
16..512, outputs 16..256) the mean prompt is about 143 tokens and the mean output about 87.
"""
from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

CORPUS_PATH = Path("/usr/share/common-licenses/GPL-3")

DEFAULT_NUM_PROMPTS = 256
DEFAULT_INPUT_LEN_RANGE = (16, 512)
DEFAULT_OUTPUT_LEN_RANGE = (16, 256)
DEFAULT_SEED = 0


class Encoder(Protocol):
    """What the dataset needs of a tokenizer (pagoda's and HF's both fit)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def load_corpus(path: str | Path = CORPUS_PATH) -> str:
    """The corpus text, or a FileNotFoundError that says how to get it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"benchmark corpus {p} not found: it ships with Debian/Ubuntu's base-files package "
            "(/usr/share/common-licenses/GPL-3); copy any GPL-3 text there or pass another corpus path")
    return p.read_text(encoding="utf-8")


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose logarithm is uniform."""
    if lo == hi:
        return lo
    # rng.random() (not randint) so the sequence stays the same across Python versions.
    x = math.exp(math.log(lo) + rng.random() * (math.log(hi + 1) - math.log(lo)))
    return min(hi, max(lo, int(x)))


def synthetic_chat_requests(tokenizer: Encoder, num_prompts: int = DEFAULT_NUM_PROMPTS,
                            input_len_range: Sequence[int] = DEFAULT_INPUT_LEN_RANGE,
                            output_len_range: Sequence[int] = DEFAULT_OUTPUT_LEN_RANGE,
                            seed: int = DEFAULT_SEED, corpus_path: str | Path = CORPUS_PATH) -> list[BenchRequest]:
    """`num_prompts` requests with log-uniform prompt and output lengths, prompts cut from the corpus."""
    in_lo, in_hi = _check_range("input_len_range", input_len_range)
    out_lo, out_hi = _check_range("output_len_range", output_len_range)
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    corpus = tokenizer.encode(load_corpus(corpus_path), add_special_tokens=False)
    if not corpus:
        raise ValueError(f"benchmark corpus {corpus_path} tokenized to nothing")
    # Repeat the corpus if a prompt could be longer than it, so every offset has a full window.
    corpus = corpus * math.ceil((in_hi + len(corpus)) / len(corpus))
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        in_len = log_uniform_int(rng, in_lo, in_hi)
        out_len = log_uniform_int(rng, out_lo, out_hi)
        start = int(rng.random() * (len(corpus) - in_len))
        requests.append(BenchRequest(corpus[start:start + in_len], out_len))
    return requests


def _check_range(name: str, r: Sequence[int]) -> tuple[int, int]:
    if len(r) != 2 or not 1 <= r[0] <= r[1]:
        raise ValueError(f"{name} must be two integers 1 <= lo <= hi, got {list(r)}")
    return int(r[0]), int(r[1])


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """Workload flags shared by `pagoda bench throughput` and `pagoda bench serve`."""
    g = p.add_argument_group("workload (log-uniform lengths, prompts cut from GPL-3 text)")
    g.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="number of requests")
    g.add_argument("--input-len-range", type=int, nargs=2, default=list(DEFAULT_INPUT_LEN_RANGE),
                   metavar=("LO", "HI"), help="prompt lengths in tokens, inclusive")
    g.add_argument("--output-len-range", type=int, nargs=2, default=list(DEFAULT_OUTPUT_LEN_RANGE),
                   metavar=("LO", "HI"), help="output lengths in tokens, inclusive")
    # The engine flags may already define --seed (it then seeds both the engine and the workload).
    if "--seed" not in p._option_string_actions:
        g.add_argument("--seed", type=int, default=None, help=f"workload seed (default {DEFAULT_SEED})")


def seed_from_args(args: argparse.Namespace) -> int:
    return DEFAULT_SEED if getattr(args, "seed", None) is None else int(args.seed)


def requests_from_args(args: argparse.Namespace, tokenizer: Encoder) -> list[BenchRequest]:
    """The workload that add_dataset_args' flags describe."""
    return synthetic_chat_requests(tokenizer, args.num_prompts, args.input_len_range, args.output_len_range,
                                   seed_from_args(args))
