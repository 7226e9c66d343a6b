"""Model-based proposers: a smaller draft model with its own paged KV pool, or the target's own first L
layers (self-speculative early exit, as in LayerSkip and Draft & Verify).

Both run k batched single-token passes per step after one pass that brings the draft's KV up to date.
The self draft writes its layers' KV into the target's own pool at positions >= num_computed_tokens, in slots
it allocates there for the verification that follows (the scheduler's allocation for that step finds them in
place, and Scheduler.update frees what the step did not keep): a layer's KV at a position depends only on the
tokens up to it, and the target's verification pass rewrites every one of those positions (all layers) before
anything reads them, so nothing drafted leaks into output.
"""
from __future__ import annotations

import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Sequence
from pagoda.executor.model_runner import ModelRunner


def sample_draft(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[torch.Tensor | None]]:
    """Greedy rows take the argmax; others draw from q = softmax(logits / T) and keep q for verification."""
    tokens: list[int] = []
    qs: list[torch.Tensor | None] = []
    for row, seq in zip(logits, seqs):
        p = seq.request.params
        if p.greedy:
            tokens.append(int(row.argmax()))
            qs.append(None)
            continue
        q = (row / p.temperature).softmax(dim=-1)
        tokens.append(int(torch.multinomial(q, 1, generator=seq.generator).item()))
        qs.append(q)
    return tokens, qs


class ModelDraftProposer:
    """Drafts with `runner` (a draft model, or the target itself with `num_layers` = L).

    kv: the draft's own KVCacheManager (draft model), or None to write into the target's pool (self)."""

    def __init__(self, runner: ModelRunner, target_kv: KVCacheManager, draft_kv: KVCacheManager | None,
                 num_layers: int | None) -> None:
        self.runner = runner
        self.target_kv = target_kv
        self.draft_kv = draft_kv
        self.num_layers = num_layers
        self.num_computed: dict[int, int] = {}  # draft model: tokens of each sequence with KV in the draft pool

    def release_except(self, live: set[int]) -> None:
        """Drop draft KV of sequences that finished or were preempted."""
        if self.draft_kv is None:
            return
        for seq_id in [s for s in self.num_computed if s not in live]:
            del self.num_computed[seq_id]
            self.draft_kv.free(seq_id)

    def rollback(self, seq: Sequence) -> None:
        """After verification only KV of accepted tokens is valid (the rest is overwritten later)."""
        if seq.seq_id in self.num_computed:
            self.num_computed[seq.seq_id] = min(self.num_computed[seq.seq_id], seq.num_computed_tokens)

    def _reserve(self, seq: Sequence, k: int) -> tuple[int, list[int]] | None:
        """Slots for the draft's writes; (first position to feed, block table), or None if the pool is short.
        A self draft writes into the target's slots for the next verification (positions num_computed_tokens =
        n - 1 .. n + k - 1 cover its n - 1 .. n + k - 2)."""
        n = seq.num_tokens
        if self.draft_kv is None:
            if not self.target_kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, k):
                return None
            return seq.num_computed_tokens, self.target_kv.block_tables[seq.seq_id]
        # Draft KV past the target's computed tokens may hold proposals never verified (the budget skipped them).
        start = min(self.num_computed.get(seq.seq_id, 0), seq.num_computed_tokens)
        if not self.draft_kv.allocate_slots(seq.seq_id, start, n - start + k - 1):
            self.draft_kv.free(seq.seq_id)
            self.num_computed.pop(seq.seq_id, None)
            return None
        return start, self.draft_kv.block_tables[seq.seq_id]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to ks[i] tokens per sequence, and q ([k, V]) for rows that sample (None for greedy rows)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        live: list[int] = []
        tables: dict[int, list[int]] = {}
        rows: list[tuple[list[int], int, list[int]]] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            reserved = self._reserve(seq, k)
            if reserved is None:
                continue
            start, table = reserved
            live.append(i)
            tables[i] = table
            rows.append((seq.token_ids[start:], start, table))
        if not live:
            return drafts, [None] * len(seqs)
        # Copy-on-write copies a shared block before the draft writes into it.
        self.runner.copy_blocks((self.draft_kv or self.target_kv).take_copies())
        depth = 0
        while True:
            logits = self.runner.forward_rows(rows, self.num_layers)
            tokens, q = sample_draft(logits, [seqs[i] for i in live])
            for i, t, qi in zip(live, tokens, q):
                drafts[i].append(t)
                qs[i].append(qi)
                if self.draft_kv is not None:
                    self.num_computed[seqs[i].seq_id] = seqs[i].num_tokens + depth
            depth += 1
            live = [i for i in live if ks[i] > depth]
            if not live:
                break
            rows = [([drafts[i][-1]], seqs[i].num_tokens + depth - 1, tables[i]) for i in live]
        probs = [None if not q or q[0] is None else torch.stack(q) for q in qs]  # type: ignore[misc]
        return drafts, probs
