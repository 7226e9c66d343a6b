"""Property test: speculative rollback never leaks KV blocks, never serves KV of rejected proposals (or of
another sequence), and only ever hashes blocks full of accepted tokens into the prefix cache."""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, Sequence
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams


def check_pool(kv: KVCacheManager) -> None:
    refs = Counter(b for table in kv.block_tables.values() for b in table)
    for b in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[b] == refs.get(b, 0), f"block {b} refcount mismatch"
    assert kv.pool.num_free == sum(1 for r in kv.pool.ref_counts if r == 0)


class SpecSimulator:
    """Drives scheduler + KV manager as the engine does with speculation, tracking what each KV slot holds:
    the token prefix whose last token's KV was written there (K/V at p depend on tokens 0..p)."""

    def __init__(self, kv: KVCacheManager, sched: Scheduler, rng: random.Random, max_k: int, self_draft: bool) -> None:
        self.kv, self.sched, self.rng, self.max_k, self.self_draft = kv, sched, rng, max_k, self_draft
        self.content: dict[tuple[int, int], tuple] = {}
        self.ids = iter(range(10**6))
        self.accepted = self.drafted = 0

    def new_seq(self, req: Request, tokens: list[int], index: int) -> Sequence:
        seq = Sequence(next(self.ids), req, index, list(tokens), len(req.prompt_token_ids))
        req.seqs.append(seq)
        return seq

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            for off in range(self.kv.block_size):
                if (src, off) in self.content:
                    self.content[(dst, off)] = self.content[(src, off)]

    def _write(self, seq: Sequence, pos: int, prefix: tuple) -> None:
        table = self.kv.block_tables[seq.seq_id]
        self.content[(table[pos // self.kv.block_size], pos % self.kv.block_size)] = prefix

    def propose(self) -> None:
        """The end of a step (Speculator.propose): proposals for the next step; an early-exit draft first allocates
        the target's slots for positions num_computed .. num_tokens + k - 2 and writes partial KV there (it may
        find the pool short, and propose nothing)."""
        drafts = {}
        for seq in self.sched.running:
            room = seq.request.max_tokens - seq.num_output_tokens - 1
            if seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1 or room <= 0:
                continue
            k = self.rng.randint(0, min(self.max_k, room))
            if k and self.self_draft:
                if not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, k):
                    continue
                self._copy(self.kv.take_copies())
                for pos in range(seq.num_computed_tokens, seq.num_tokens + k - 1):
                    self._write(seq, pos, ("draft",))
            drafts[seq] = [self.rng.randint(0, 2) for _ in range(k)]
        self.sched.update_draft_token_ids(drafts)

    def step(self) -> list[Sequence]:
        kv, bs = self.kv, self.kv.block_size
        out = self.sched.schedule()
        self._copy(out.block_copies)
        check_pool(kv)
        for seq, n in zip(out.seqs, out.num_scheduled):
            table = kv.block_tables[seq.seq_id]
            full = seq.token_ids + seq.spec_token_ids
            assert len(table) * bs >= seq.num_computed_tokens + n
            for pos in range(seq.num_computed_tokens):  # every KV it reads holds its own accepted tokens
                assert self.content.get((table[pos // bs], pos % bs)) == tuple(seq.token_ids[:pos + 1]), \
                    "wrong KV served"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self._write(seq, pos, tuple(full[:pos + 1]))
        finished = []
        rejected = {}
        for row, (seq, n) in enumerate(zip(list(out.seqs), list(out.num_scheduled))):
            req = seq.request
            num_spec = seq.num_computed_tokens + n - seq.num_tokens
            if num_spec > 0:  # verification: accept a random prefix, then the target's own token
                a = self.rng.randint(0, num_spec)
                self.drafted += num_spec
                self.accepted += a
                seq.token_ids += seq.spec_token_ids[:a] + [self.rng.randint(0, 2)]
                rejected[row] = num_spec - a
                group = [seq]
            else:
                if seq.num_computed_tokens + n < seq.num_tokens:
                    continue
                group = [seq]
                if seq.index == 0 and len(req.seqs) < req.params.n and seq.num_output_tokens == 0:
                    for _ in range(req.params.n - 1):
                        child = self.new_seq(req, seq.token_ids, len(req.seqs))
                        child.num_computed_tokens = seq.num_tokens
                        kv.fork(seq.seq_id, child.seq_id)
                        self.sched.add_running(child)
                        group.append(child)
                for s in group:
                    s.token_ids.append(self.rng.randint(0, 2))
            for s in group:
                if s.num_output_tokens >= req.max_tokens:
                    s.finish_reason = "length"
                    finished.append(s)
        self.sched.update(out, rejected)  # the engine's call: rolls verified rows back to their accepted tokens
        for row in rejected:
            seq = out.seqs[row]
            if not seq.finished:
                assert seq.num_computed_tokens == seq.num_tokens - 1
        for seq in out.seqs:  # every scheduled row keeps blocks for its computed tokens only
            if not seq.finished:
                assert len(kv.block_tables[seq.seq_id]) == kv.blocks_needed(seq.num_computed_tokens)
        check_pool(kv)
        self.propose()
        check_pool(kv)
        return finished


PREFIXES = [list(range(100, 120)), [7] * 9]
request_spec = st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1, max_size=20),
                         st.integers(1, 30), st.integers(1, 3), st.sampled_from([None, "a"]))


@settings(max_examples=80, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=10), num_blocks=st.integers(14, 40),
       block_size=st.sampled_from([1, 2, 4, 16]), budget=st.integers(2, 48), max_seqs=st.integers(1, 6),
       max_k=st.integers(1, 6), prefix_caching=st.booleans(), self_draft=st.booleans(), seed=st.integers(0, 1000))
def test_speculative_rollback_leaks_nothing_and_serves_only_accepted_kv(specs, num_blocks, block_size, budget,
                                                                       max_seqs, max_k, prefix_caching, self_draft,
                                                                       seed):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)
    sim = SpecSimulator(kv, sched, random.Random(seed), max_k, self_draft)
    pending = list(specs)
    step = 0
    while pending or sched.has_work():
        step += 1
        assert step < 5000, "no progress"
        if pending and step % 2:
            shared, tail, out_len, n, salt = pending.pop(0)
            prompt = (PREFIXES[shared] if shared < len(PREFIXES) else []) + tail
            if kv.blocks_needed(len(prompt) + out_len) > num_blocks:
                continue  # the engine rejects these at admission
            req = Request(str(step), None, prompt, SamplingParams(n=n), out_len, cache_salt=salt)
            sched.add(sim.new_seq(req, prompt, 0))
        sim.step()
    assert kv.pool.num_free == num_blocks, "blocks leaked"
    assert not kv.block_tables
