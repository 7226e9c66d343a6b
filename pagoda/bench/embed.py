"""`pagoda bench embed`: an embedding model in Pagoda and in sentence-transformers (torch), in one process on the
same threads, alternating runs so both see the same machine: throughput over N sentences at one batch size, and
batch-1 latency, with the ratios. Sentences are windows of the benchmark corpus (bench/corpus/GPL-3) of
log-uniform token lengths, decoded back to text, so each side tokenizes them itself.

With --compare vllm, vLLM's CPU pooling runner is a third side: one engine in its own venv for the whole run
(vllm_embed_peer.py), its rounds and batch-1 requests alternating with the other two."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pagoda.bench.datasets import CORPUS_PATH, load_corpus, log_uniform_int

if TYPE_CHECKING:
    from pagoda.bench.vllm_embed_peer import VllmEmbedPeer


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
    p.add_argument("--threads", type=int, default=None, help="compute threads of each side (default: Pagoda's choice)")
    p.add_argument("--cpus", default=None, help="cores every side runs on, e.g. 0-7 (default: this process's)")
    p.add_argument("--corpus", default=str(CORPUS_PATH), help="text the sentences are cut from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", nargs="+", choices=["vllm"], default=[],
                   help="also run vLLM's CPU pooling runner (LLM(runner='pooling')) at --dtype on the same cores, "
                        "alternating with the others. Its throughput round is one LLM.embed over all the "
                        "sentences with max_num_seqs = --batch-size and a token budget that never binds first, "
                        "so its scheduler embeds them in order, at most that many per step (vLLM's own way to "
                        "run a batch size, as sentence-transformers' encode is theirs); its batch-1 requests are "
                        "one LLM.embed each. Engine start-up takes a minute or two, untimed, and the bench waits "
                        "about a second after each vLLM call, while vLLM's worker still polls for work")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of the venv with vLLM's CPU build, for --compare vllm (default: the venv "
                        "scripts/install-peers.sh vllm makes in the cache folder, ~/.cache/pagoda/peers/vllm)")
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


class VllmSide:
    """The vLLM side of one bench: a VllmEmbedPeer whose failure ends only that side. `error` then holds vLLM's
    one-line reason, and its log is kept (`log_path`); after a clean run the log is removed."""

    def __init__(self, python: str, model: str, texts: Sequence[str], *, batch_size: int, max_model_len: int,
                 dtype: str, cores: Sequence[int] | None) -> None:
        from pagoda.bench.vllm_embed_peer import VllmEmbedPeer

        self._tmp = tempfile.TemporaryDirectory(prefix="pagoda-vllm-embed-")
        fd, self.log_path = tempfile.mkstemp(prefix="pagoda-vllm-embed-", suffix=".log")
        os.close(fd)
        self.peer: VllmEmbedPeer | None = VllmEmbedPeer(
            python, model, texts, batch_size=batch_size, max_model_len=max_model_len, dtype=dtype, cores=cores,
            log_path=self.log_path, job_path=os.path.join(self._tmp.name, "job.json"))
        self.error: str | None = None
        self.ready: dict[str, Any] = {}

    def start(self) -> list[list[float]] | None:
        """Load the engine; the check sentences' embeddings, or None where vLLM failed."""
        ready = self._call(lambda peer: peer.start())
        self.ready = {k: v for k, v in (ready or {}).items() if k not in ("embeddings", "event")}
        return None if ready is None else list(ready["embeddings"])

    def throughput(self) -> float | None:
        return self._call(lambda peer: peer.throughput())

    def latency(self, index: int) -> float | None:
        return self._call(lambda peer: peer.latency(index))

    def _call(self, fn: Callable[[VllmEmbedPeer], Any]) -> Any:
        from pagoda.bench.vllm_embed_peer import IDLE_S
        from pagoda.bench.vllm_peer import PeerFailed

        if self.peer is None:
            return None
        try:
            value = fn(self.peer)
        except PeerFailed as e:
            self.error = str(e)
            self.close()
            return None
        time.sleep(IDLE_S)  # until vLLM's worker stops polling, before another side is timed
        return value

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        self._tmp.cleanup()
        if self.error is None:
            with contextlib.suppress(OSError):
                os.remove(self.log_path)

    def __enter__(self) -> VllmSide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _min_cosine(a: Any, b: Any) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float(), b.float()).min().item())


def main(args: argparse.Namespace) -> int:
    import torch

    from pagoda.config import PoolingConfig
    from pagoda.cpus import affinity
    from pagoda.executor.pooling_runner import PoolingRunner

    for name in ("num_sentences", "batch_size", "rounds", "latency_samples", "min_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < args.min_tokens:
        raise ValueError("--max-tokens must be at least --min-tokens")
    vllm_python = None
    if "vllm" in args.compare:
        from pagoda.bench.vllm_peer import DEFAULT_VLLM_PYTHON, check_python

        vllm_python = args.vllm_python or DEFAULT_VLLM_PYTHON
        check_python(vllm_python)  # before loading anything
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
    dtype = str(runner.dtype).removeprefix("torch.")
    print(f"pagoda bench embed: {runner.folder}, {len(texts)} sentences of {args.min_tokens}-{args.max_tokens} "
          f"tokens, {torch.get_num_threads()} threads, Pagoda {dtype}"
          f"{f', vLLM {dtype}' if vllm_python else ''} vs sentence-transformers fp32", file=sys.stderr, flush=True)

    def pagoda_embed(batch: list[str]) -> torch.Tensor:
        return torch.stack(runner.run([runner.tokenize(t, truncate=-1) for t in batch]))

    def st_embed(batch: list[str]) -> torch.Tensor:
        return st.encode(batch, batch_size=args.batch_size, convert_to_tensor=True)

    def timed_round(run: Callable[[], object]) -> Callable[[], float]:
        def rate() -> float:
            t0 = time.perf_counter()
            run()
            return len(texts) / (time.perf_counter() - t0)
        return rate

    def timed_one(embed: Callable[[list[str]], object]) -> Callable[[int], float]:
        def ms(index: int) -> float:
            t0 = time.perf_counter()
            embed([texts[index]])
            return (time.perf_counter() - t0) * 1000
        return ms

    def pagoda_round() -> None:
        for i in range(0, len(texts), args.batch_size):
            pagoda_embed(texts[i:i + args.batch_size])

    # A throughput round and a batch-1 request of each side, by name; vLLM's are timed inside its peer.
    rounds: dict[str, Callable[[], float | None]] = {
        "pagoda": timed_round(pagoda_round),
        "sentence-transformers": timed_round(lambda: st_embed(texts)),  # its own batching (it sorts by length)
    }
    ones: dict[str, Callable[[int], float | None]] = {"pagoda": timed_one(pagoda_embed),
                                                      "sentence-transformers": timed_one(st_embed)}
    # Warm both (first-call allocations, lazy inits) and check they compute the same vectors.
    check = texts[:args.batch_size]
    reference = st_embed(check).float()
    cos = _min_cosine(pagoda_embed(check), reference)
    vllm: VllmSide | None = None
    vllm_cos: float | None = None
    with contextlib.ExitStack() as stack:
        if vllm_python is not None:
            print(f"  vllm: starting its engine with {vllm_python} (a minute or two) ...", file=sys.stderr,
                  flush=True)
            vllm = stack.enter_context(VllmSide(vllm_python, runner.folder, texts, batch_size=args.batch_size,
                                                max_model_len=runner.max_model_len, dtype=dtype,
                                                cores=affinity()[:torch.get_num_threads()]))
            embeddings = vllm.start()
            if embeddings is None:
                print(f"  vllm: failed, going on without it: {vllm.error}", file=sys.stderr, flush=True)
            else:
                vllm_cos = _min_cosine(torch.tensor(embeddings), reference)
                print(f"  vllm {vllm.ready.get('version')}: ready in {vllm.ready.get('startup_s', 0):.0f} s",
                      file=sys.stderr, flush=True)
                rounds["vllm"], ones["vllm"] = vllm.throughput, vllm.latency
        sides = {name: SideResult(name, [], []) for name in rounds}
        for r in range(args.rounds):
            for name, run in rounds.items():
                if (rate := run()) is not None:
                    sides[name].sentences_per_s.append(rate)
                    print(f"  round {r + 1} {name}: {rate:.1f} sentences/s", file=sys.stderr, flush=True)
        rng = random.Random(args.seed + 1)
        for _ in range(args.latency_samples):
            index = rng.randrange(len(texts))
            for name, one in ones.items():
                if (ms := one(index)) is not None:
                    sides[name].latency_ms.append(ms)
    vllm_error = vllm.error if vllm is not None else None
    if vllm_error is not None:  # the bench goes on with the two sides that ran
        sides.pop("vllm", None)
    _print_table(list(sides.values()))
    p, s, v = sides["pagoda"], sides["sentence-transformers"], sides.get("vllm")
    throughput_ratio = p.best_sentences_per_s / s.best_sentences_per_s
    latency_ratio = p.median_latency_ms / s.median_latency_ms
    tput = f"Pagoda {throughput_ratio:.2f}x sentence-transformers"
    lat = f"Pagoda {latency_ratio:.2f}x sentence-transformers'"
    lowest = f"lowest cosine {cos:.6f}"
    if v is not None:
        tput += f", {p.best_sentences_per_s / v.best_sentences_per_s:.2f}x vLLM"
        lat += f", {p.median_latency_ms / v.median_latency_ms:.2f}x vLLM's"
        lowest += f", vLLM {vllm_cos:.6f}"
    print(f"throughput at batch {args.batch_size}: {tput}; batch-1 p50 latency: {lat}; {lowest}")
    if vllm is not None and vllm.error is not None:
        print(f"vllm: failed: {vllm.error} (its log: {vllm.log_path})")
    if args.output_json:
        report: dict[str, Any] = {
            "model": runner.folder, "num_sentences": len(texts), "batch_size": args.batch_size,
            "threads": torch.get_num_threads(), "dtype": str(runner.dtype), "min_cosine": cos,
            "throughput_ratio": throughput_ratio, "latency_ratio": latency_ratio,
            "sides": [side.to_dict() for side in sides.values()]}
        if vllm is not None:
            report["vllm"] = {**vllm.ready, "error": vllm_error, "min_cosine": vllm_cos}
            if v is not None:
                report["vllm"].update(throughput_ratio=p.best_sentences_per_s / v.best_sentences_per_s,
                                      latency_ratio=p.median_latency_ms / v.median_latency_ms)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 1 if vllm_error is not None else 0


def _print_table(sides: list[SideResult]) -> None:
    print(f"{'':24}{'sentences/s (best)':>20}{'batch-1 p50 ms':>16}{'batch-1 p90 ms':>16}")
    for side in sides:
        print(f"{side.name:24}{side.best_sentences_per_s:>20.1f}{side.median_latency_ms:>16.2f}"
              f"{side.p90_latency_ms:>16.2f}")
