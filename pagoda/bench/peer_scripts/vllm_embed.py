"""vLLM's pooling runner on `pagoda bench embed`'s sentences, run by the vLLM venv's python (not pagoda's).

Standalone on purpose: it imports nothing from pagoda, since the peer's venv does not have it.

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        ~/.cache/pagoda/peers/vllm/bin/python vllm_embed.py JOB.json

JOB.json: {"model": sentence-transformers folder, "dtype": "float32" | "bfloat16", "max_model_len": int,
           "batch_size": int, "texts": [str, ...], "check": int, "engine_kwargs": {...} (optional)}

It builds `vllm.LLM(model, runner="pooling")` with max_num_seqs = batch_size and a token budget that never
binds first (batch_size * max_model_len), so each engine step embeds up to batch_size sentences. It then
answers one command per line on stdin, so that the bench can alternate it with the other sides:

    (at start)                 -> {"event": "ready", "version", "startup_s", "embeddings": the first `check`
                                   texts' vectors (a warm-up too)}
    {"op": "throughput"}       -> {"elapsed_s", "sentences_per_s"}: every text in one `LLM.embed` call
    {"op": "latency", "index"} -> {"latency_ms"}: `LLM.embed([texts[index]])`
    {"op": "quit"} or EOF      -> exit 0

Each answer is one JSON line prefixed with RESULT_PREFIX, on a private copy of stdout: the script points
its own stdout (and so the engine processes' stdout) at stderr, which carries every log. A failure answers
{"error": "Type: message"} and exits 1.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

RESULT_PREFIX = "PAGODA_PEER_RESULT "
JOB_VERSION = 1
# The recipe in shared/PEERS.md: CPU build, 4 GiB KV cache, both cores bound (the default leaves one idle).
DEFAULT_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def load_job(path: str) -> dict[str, Any]:
    """Read and check a job file; raises ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        job = json.load(f)
    if not isinstance(job, dict):
        raise ValueError("job must be a JSON object")
    if job.get("version", JOB_VERSION) != JOB_VERSION:
        raise ValueError(f"job version {job.get('version')} is not {JOB_VERSION}")
    for key in ("model", "dtype", "max_model_len", "batch_size", "texts"):
        if key not in job:
            raise ValueError(f"job lacks {key!r}")
    texts = job["texts"]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("job 'texts' must be a non-empty list of strings")
    return job


class Embedder:
    """One vLLM engine over the job's texts."""

    def __init__(self, job: dict[str, Any]) -> None:
        import vllm

        self.texts: list[str] = job["texts"]
        max_len, batch = int(job["max_model_len"]), int(job["batch_size"])
        # Truncate as sentence-transformers does (max_seq_length): a decoded window may re-encode a token longer.
        self.tokenization_kwargs = {"truncate_prompt_tokens": max_len}
        self.version = getattr(vllm, "__version__", None)
        t0 = time.perf_counter()
        self.llm = vllm.LLM(model=job["model"], runner="pooling", dtype=job["dtype"], max_model_len=max_len,
                            max_num_seqs=batch, max_num_batched_tokens=batch * max_len, seed=0,
                            **(job.get("engine_kwargs") or {}))
        self.startup_s = time.perf_counter() - t0

    def embed(self, texts: list[str]) -> list[list[float]]:
        outs = self.llm.embed(texts, use_tqdm=False, tokenization_kwargs=dict(self.tokenization_kwargs))
        return [list(o.outputs.embedding) for o in outs]

    def ready(self, check: int) -> dict[str, Any]:
        embeddings = self.embed(self.texts[:max(1, check)])
        self.embed(self.texts[:1])  # and warm batch 1
        return {"event": "ready", "version": self.version, "startup_s": self.startup_s, "embeddings": embeddings}

    def answer(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        if op == "throughput":
            t0 = time.perf_counter()
            n = len(self.embed(self.texts))
            elapsed = time.perf_counter() - t0
            return {"op": op, "elapsed_s": elapsed, "sentences_per_s": n / elapsed}
        if op == "latency":
            text = self.texts[int(cmd["index"])]
            t0 = time.perf_counter()
            self.embed([text])
            return {"op": op, "latency_ms": (time.perf_counter() - t0) * 1000}
        raise ValueError(f"unknown command {cmd!r}")


def _send(out: TextIO, result: dict[str, Any]) -> None:
    out.write(RESULT_PREFIX + json.dumps(result) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: vllm_embed.py JOB.json", file=sys.stderr)
        return 2
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    # Answers go out on a private copy of stdout; everything else (vLLM logs to stdout, and its engine
    # processes inherit fd 1) goes to stderr.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        job = load_job(argv[0])
        embedder = Embedder(job)
        _send(out, embedder.ready(int(job.get("check", job["batch_size"]))))
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            _send(out, embedder.answer(cmd))
    except Exception as e:  # the bench shows this one line; the traceback stays in the log
        import traceback

        traceback.print_exc()
        _send(out, {"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


if __name__ == "__main__":  # required: vLLM's engine core starts in a spawned process
    sys.exit(main())
