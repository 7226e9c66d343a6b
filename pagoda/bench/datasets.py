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
from typing import Any, Protocol

CORPUS_DIR = Path(__file__).parent / "corpus"  # license texts as plain English (corpus/README.md)
CORPUS_PATH = CORPUS_DIR / "GPL-3"

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
    output_len: int  # tokens to generate (with a schema: the cap; the constraint ends the output)
    schema: dict[str, Any] | None = None  # json-schema dataset: the output must match it
    temperature: float = 0.0


# The json-schema workload's distinct schemas (also `pagoda bench structured`'s): bounded strings and arrays,
# so that a small model sampling at 0.8 finishes inside the token cap.
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


def json_schema_requests(tokenizer: Encoder, num_prompts: int = 64, max_tokens: int = 128,
                         seed: int = DEFAULT_SEED) -> list[BenchRequest]:
    """Short prompts, each asking for an object under one of SCHEMAS in turn, sampled at temperature 0.8."""
    base = synthetic_chat_requests(tokenizer, num_prompts, (16, 64), (1, 1), seed)
    return [BenchRequest(r.prompt_token_ids, max_tokens, SCHEMAS[i % len(SCHEMAS)], 0.8) for i, r in enumerate(base)]


def load_corpus(path: str | Path = CORPUS_PATH) -> str:
    """The corpus text, or a FileNotFoundError that says how to get it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"benchmark corpus {p} not found: pass a text file that exists")
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
    # Repeat the corpus if a prompt could be longer than it, so every offset has a full window.
    corpus = _long_corpus(tokenizer, in_hi, corpus_path)
    if not corpus:
        raise ValueError(f"benchmark corpus {corpus_path} tokenized to nothing")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        in_len = log_uniform_int(rng, in_lo, in_hi)
        out_len = log_uniform_int(rng, out_lo, out_hi)
        requests.append(BenchRequest(_corpus_window(corpus, rng, in_len), out_len))
    return requests


def _corpus_window(corpus: list[int], rng: random.Random, length: int) -> list[int]:
    start = int(rng.random() * (len(corpus) - length))
    return corpus[start:start + length]


def _long_corpus(tokenizer: Encoder, min_len: int, corpus_path: str | Path) -> list[int]:
    corpus = tokenizer.encode(load_corpus(corpus_path), add_special_tokens=False)
    return corpus * math.ceil((min_len + len(corpus)) / len(corpus))


def shared_prefix_requests(tokenizer: Encoder, num_prompts: int = 128, num_prefixes: int = 8,
                           prefix_len: int = 512, question_len: int = 32,
                           output_len_range: Sequence[int] = (16, 64), seed: int = DEFAULT_SEED,
                           corpus_path: str | Path = CORPUS_PATH) -> list[BenchRequest]:
    """RAG/agent-like traffic: each request is one of `num_prefixes` long shared prefixes (system prompts or
    documents) followed by its own question, in seeded random order."""
    out_lo, out_hi = _check_range("output_len_range", output_len_range)
    corpus = _long_corpus(tokenizer, prefix_len + question_len, corpus_path)
    rng = random.Random(seed)
    prefixes = [_corpus_window(corpus, rng, prefix_len) for _ in range(num_prefixes)]
    return [BenchRequest(prefixes[rng.randrange(num_prefixes)] + _corpus_window(corpus, rng, question_len),
                         log_uniform_int(rng, out_lo, out_hi)) for _ in range(num_prompts)]


def multi_turn_requests(tokenizer: Encoder, num_conversations: int = 16, num_turns: int = 6,
                        system_len: int = 128, user_len: int = 48, assistant_len: int = 96,
                        output_len: int = 32, seed: int = DEFAULT_SEED,
                        corpus_path: str | Path = CORPUS_PATH) -> list[BenchRequest]:
    """A replayed chat log: turn t resends the whole conversation so far (system, then user and recorded
    assistant messages) plus a new user message. Turns are ordered round-robin across conversations."""
    corpus = _long_corpus(tokenizer, system_len + user_len + assistant_len, corpus_path)
    rng = random.Random(seed)
    histories = [_corpus_window(corpus, rng, system_len) for _ in range(num_conversations)]
    requests = []
    for _ in range(num_turns):
        for c in range(num_conversations):
            histories[c] = histories[c] + _corpus_window(corpus, rng, user_len)
            requests.append(BenchRequest(list(histories[c]), output_len))
            histories[c] = histories[c] + _corpus_window(corpus, rng, assistant_len)
    return requests


EDIT_INSTRUCTIONS = ("Repeat the following text exactly, word for word:",
                     "The following text has a few typos. Rewrite it in full with the typos fixed:",
                     "Copy the following passage, keeping every sentence as it is:")


def _typo(word: str, rng: random.Random) -> str:
    if len(word) < 4:
        return word
    i = 1 + int(rng.random() * (len(word) - 2))
    return word[:i - 1] + word[i] + word[i - 1] + word[i + 1:]  # swap two neighbouring letters


def edit_requests(tokenizer: Encoder, num_prompts: int = 32, input_len_range: Sequence[int] = (64, 256),
                  seed: int = DEFAULT_SEED, corpus_path: str | Path = CORPUS_PATH) -> list[BenchRequest]:
    """Input-grounded traffic (where speculative decoding by prompt lookup shines): each prompt asks the model
    to repeat or correct a passage of the corpus, with the chat template when the tokenizer has one, and asks
    for about as many tokens as the passage holds, so the output copies long spans of the input."""
    lo, hi = _check_range("input_len_range", input_len_range)
    words = load_corpus(corpus_path).split()
    rng = random.Random(seed)
    template = getattr(tokenizer, "apply_chat_template", None)
    requests = []
    for i in range(num_prompts):
        target = log_uniform_int(rng, lo, hi)
        n_words = max(4, int(target / 1.4))  # English runs about 1.3-1.5 tokens a word
        start = int(rng.random() * (len(words) - n_words))
        passage_words = words[start:start + n_words]
        instruction = EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]
        if "typos" in instruction:
            passage_words = [_typo(w, rng) if rng.random() < 0.05 else w for w in passage_words]
        passage = " ".join(passage_words)
        text = f"{instruction}\n\n{passage}"
        if template is not None:
            prompt = tokenizer.encode(template([{"role": "user", "content": text}], add_generation_prompt=True),
                                      add_special_tokens=False)
        else:
            prompt = tokenizer.encode(text, add_special_tokens=False)
        requests.append(BenchRequest(prompt, len(tokenizer.encode(passage, add_special_tokens=False))))
    return requests


def max_prefix_hit_rate(requests: Sequence[BenchRequest], block_size: int) -> float:
    """The best hit rate any full-block prefix cache can reach on this workload in this order (infinite
    cache; the last prompt token is always computed). Benchmarks print it next to the measured rate."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in requests:
        ids = r.prompt_token_ids
        full = (len(ids) - 1) // block_size
        i = 0
        while i < full and tuple(ids[:(i + 1) * block_size]) in seen:
            i += 1
        hits += i * block_size
        total += len(ids)
        for j in range(1, len(ids) // block_size + 1):
            seen.add(tuple(ids[:j * block_size]))
    return hits / total if total else 0.0


def _check_range(name: str, r: Sequence[int]) -> tuple[int, int]:
    if len(r) != 2 or not 1 <= r[0] <= r[1]:
        raise ValueError(f"{name} must be two integers 1 <= lo <= hi, got {list(r)}")
    return int(r[0]), int(r[1])


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """Workload flags shared by `pagoda bench throughput` and `pagoda bench serve`."""
    g = p.add_argument_group("workload (log-uniform lengths, prompts cut from GPL-3 text)")
    g.add_argument("--dataset", choices=["chat", "prefix", "multiturn", "edit", "json-schema"], default="chat",
                   help="chat: independent prompts; prefix: --num-prefixes shared prefixes of --prefix-len "
                        "tokens + a --question-len question; multiturn: replayed conversations; edit: repeat or "
                        "correct a passage of --input-len-range tokens (input-grounded: outputs copy the input); "
                        "json-schema: each request a JSON object under one of several schemas (response_format), "
                        "capped at the top of --output-len-range tokens")
    g.add_argument("--num-prefixes", type=int, default=8)
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--question-len", type=int, default=32)
    g.add_argument("--num-turns", type=int, default=6, help="multiturn: turns per conversation")
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
    dataset = getattr(args, "dataset", "chat")
    if dataset == "prefix":
        return shared_prefix_requests(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len,
                                      args.question_len, args.output_len_range, seed_from_args(args))
    if dataset == "edit":
        return edit_requests(tokenizer, args.num_prompts, args.input_len_range, seed_from_args(args))
    if dataset == "json-schema":
        return json_schema_requests(tokenizer, args.num_prompts, args.output_len_range[1], seed_from_args(args))
    if dataset == "multiturn":
        return multi_turn_requests(tokenizer, max(1, args.num_prompts // args.num_turns), args.num_turns,
                                   seed=seed_from_args(args))
    return synthetic_chat_requests(tokenizer, args.num_prompts, args.input_len_range, args.output_len_range,
                                   seed_from_args(args))
