"""llama.cpp peer, run under llama-cpp-python's own venv: batched greedy decode through the C API.

llama-cpp-python's high-level `Llama` and its server decode one sequence at a time. llama.cpp itself
batches many sequences in one `llama_decode` (its server's parallel slots do this), so this script
drives the C API the same way: every active sequence contributes its next token to one batch per step.
It reads a JSON job (token ids, so the workload is exactly Pagoda's) and prints one JSON result line:

  {"gguf": PATH, "threads": 2, "batch1": {"prompt": [ids], "output_len": N, "repeats": R},
   "batched": {"prompts": [[ids], ...], "output_lens": [N, ...]},
   "perplexity": {"windows": [[ids], ...], "score_from": [i, ...]}}   (each part optional)
"""
from __future__ import annotations

import ctypes
import json
import math
import sys
import time

import llama_cpp as L
import numpy as np

RESULT_PREFIX = "PAGODA_PEER_RESULT "


class Engine:
    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512,
                 extra_bufts: bool = True) -> None:
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts  # off: no repacked or AMX weight buffers (a build where they crash)
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.kv_unified = True  # one KV buffer for all sequences, like the server's unified slots
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """items: (token, pos, seq_id, wants_logits) -> logits rows for those that want them."""
        out: list[np.ndarray] = []
        for start in range(0, len(items), self.n_batch):
            chunk = items[start:start + self.n_batch]
            b = self.batch
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0] = seq
                b.logits[i] = want
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, want) in enumerate(chunk):
                if want:
                    ptr = L.llama_get_logits_ith(self.ctx, i)
                    out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return out


def run_batched(eng: Engine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """All sequences start at once (as 32 concurrent requests); prefill then batched greedy decode."""
    eng.clear()
    t0 = time.perf_counter()
    items = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
    first = eng.decode(items)
    nxt = [int(np.argmax(r)) for r in first]
    produced = [1] * len(prompts)
    pos = [len(p) for p in prompts]
    while True:
        active = [s for s in range(len(prompts)) if produced[s] < output_lens[s]]
        if not active:
            break
        rows = eng.decode([(nxt[s], pos[s], s, True) for s in active])
        for s, r in zip(active, rows):
            nxt[s] = int(np.argmax(r))
            pos[s] += 1
            produced[s] += 1
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": sum(output_lens),
            "prompt_tokens": sum(len(p) for p in prompts)}


def run_batch1(eng: Engine, prompt: list[int], output_len: int, repeats: int = 1) -> dict:
    """The fastest of `repeats` runs (the same rule as Pagoda's rows)."""
    runs = [_batch1_once(eng, prompt, output_len) for _ in range(max(1, repeats))]
    return min(runs, key=lambda r: r["decode_s"])


def _batch1_once(eng: Engine, prompt: list[int], output_len: int) -> dict:
    eng.clear()
    logits = eng.decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])[0]
    tok, pos = int(np.argmax(logits)), len(prompt)
    t0 = time.perf_counter()
    for _ in range(output_len - 1):
        logits = eng.decode([(tok, pos, 0, True)])[0]
        tok, pos = int(np.argmax(logits)), pos + 1
    return {"decode_s": time.perf_counter() - t0, "decode_tokens": output_len - 1}


def run_perplexity(eng: Engine, windows: list[list[int]], score_from: list[int]) -> dict:
    nll, count = 0.0, 0
    t0 = time.perf_counter()
    for ids, start in zip(windows, score_from):
        eng.clear()
        rows = eng.decode([(t, p, 0, p >= max(start - 1, 0) and p < len(ids) - 1) for p, t in enumerate(ids)])
        for r, p in zip(rows, range(max(start - 1, 0), len(ids) - 1)):
            r = r.astype(np.float64)
            m = r.max()
            nll += (m + math.log(np.exp(r - m).sum())) - r[ids[p + 1]]
            count += 1
    return {"perplexity": math.exp(nll / count), "tokens": count, "elapsed_s": time.perf_counter() - t0}


def main() -> None:
    job = json.load(open(sys.argv[1]))
    threads = job.get("threads", 2)
    result: dict = {"llama_cpp_version": L.__version__}
    if "batched" in job:
        b = job["batched"]
        n_ctx = sum(len(p) + n for p, n in zip(b["prompts"], b["output_lens"])) + 64
        eng = Engine(job["gguf"], threads, n_ctx, len(b["prompts"]), extra_bufts=job.get("extra_bufts", True))
        result["batched"] = run_batched(eng, b["prompts"], b["output_lens"])
        L.llama_free(eng.ctx)
    if "batch1" in job or "perplexity" in job:
        eng = Engine(job["gguf"], threads, job.get("n_ctx", 4096), 1, extra_bufts=job.get("extra_bufts", True))
        if "batch1" in job:
            b1 = job["batch1"]
            result["batch1"] = run_batch1(eng, b1["prompt"], b1["output_len"], b1.get("repeats", 1))
        if "perplexity" in job:
            pp = job["perplexity"]
            result["perplexity"] = run_perplexity(eng, pp["windows"], pp["score_from"])
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    _ = ctypes  # ctypes arrays back the batch fields
    main()
