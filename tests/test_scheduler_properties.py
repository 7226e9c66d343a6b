"""Property tests: the scheduler and KV cache manager never leak blocks, break their invariants,
or (with prefix caching) hand a sequence a block whose KV belongs to other tokens."""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import FREED, KVCacheManager
from pagoda.core.request import Request, Sequence
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams


def check_invariants(kv: KVCacheManager) -> None:
    refs = Counter(b for table in kv.block_tables.values() for b in table if b != FREED)
    for b in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[b] == refs.get(b, 0), f"block {b} refcount mismatch"
        assert kv.pool.ref_counts[b] >= 0
    assert kv.pool.num_free == sum(1 for r in kv.pool.ref_counts if r == 0)
    assert len(set(kv.pool._free)) == kv.pool.num_free
    for h, b in kv.pool.cached.items():
        assert kv.pool.block_hash[b] == h


class Simulator:
    """Drives the scheduler like the engine does, tracking what each physical KV slot holds."""

    def __init__(self, kv: KVCacheManager, sched: Scheduler) -> None:
        self.kv, self.sched = kv, sched
        # (block, offset) -> the token prefix whose last token's KV is there: K/V at position p depend on
        # every token up to p (attention, RoPE), so that is what must match when a block is reused.
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}
        self.ids = iter(range(10**6))

    def new_seq(self, req: Request, tokens: list[int], index: int) -> Sequence:
        seq = Sequence(next(self.ids), req, index, list(tokens), len(req.prompt_token_ids))
        req.seqs.append(seq)
        return seq

    def step(self, next_token) -> list[Sequence]:
        """One engine step; returns sequences that finished."""
        kv, bs = self.kv, self.kv.block_size
        out = self.sched.schedule()
        rank = self.sched.rank
        ranks = [rank(s) for s in self.sched.running]
        assert ranks == sorted(ranks), "running is out of rank order"
        for victim in out.preempted + out.yielded:  # victims are the highest rank (the lowest priority) running
            assert all(rank(s) <= rank(victim) for s in self.sched.running), "a higher priority was preempted"
        for src, dst in out.block_copies:
            for off in range(bs):
                if (src, off) in self.content:
                    self.content[(dst, off)] = self.content[(src, off)]
        check_invariants(kv)
        seen = set()
        for seq, n in zip(out.seqs, out.num_scheduled):
            assert n > 0 and seq.seq_id not in seen
            seen.add(seq.seq_id)
            table = kv.block_tables[seq.seq_id]
            assert len(table) * bs >= seq.num_computed_tokens + n
            # With a sliding window, attention reads from the block of the first query's first visible key.
            window = kv.sliding_window
            first = max(0, seq.num_computed_tokens - window + 1) // bs * bs if window else 0
            assert FREED not in table[first // bs:], "a block still in the window was freed"
            if window:  # what a long sequence holds stays window-sized
                held = sum(b != FREED for b in table)
                assert held <= kv.max_blocks_held(seq.num_tokens, self.sched.config.max_num_batched_tokens)
            for pos in range(first, seq.num_computed_tokens):  # every KV it reads holds its own tokens
                assert self.content.get((table[pos // bs], pos % bs)) == tuple(seq.token_ids[:pos + 1]), \
                    "wrong KV served"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.content[(table[pos // bs], pos % bs)] = tuple(seq.token_ids[:pos + 1])
        assert sum(out.num_scheduled) <= self.sched.config.max_num_batched_tokens
        finished = []
        for seq, n in zip(list(out.seqs), list(out.num_scheduled)):
            req = seq.request
            if seq.num_computed_tokens + n < seq.num_tokens:  # a prompt chunk short of the end: no token yet
                continue
            group = [seq]
            if seq.index == 0 and len(req.seqs) < req.params.n and seq.num_output_tokens == 0:
                for _ in range(req.params.n - 1):
                    child = self.new_seq(req, seq.token_ids, len(req.seqs))
                    child.num_computed_tokens = seq.num_tokens  # as the engine forks: the forward computed it all
                    kv.fork(seq.seq_id, child.seq_id)
                    self.sched.add_running(child)
                    group.append(child)
            for s in group:
                s.token_ids.append(next_token(s))
                if s.num_output_tokens >= req.max_tokens:
                    s.finish_reason = "length"
                    finished.append(s)
        self.sched.update(out, {})  # the engine's own call after the tokens are appended
        assert all(s.finished for s in finished)
        return finished


PREFIXES = [list(range(100, 140)), list(range(200, 213)), [7] * 9]
# Tails from a tiny alphabet: equal blocks at different positions must still not share KV.
request_spec = st.tuples(st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1, max_size=30),
                         st.integers(1, 30), st.integers(1, 3),
                         st.booleans(), st.integers(0, 20), st.sampled_from([None, "a", "b"]), st.integers(0, 2))


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=12), num_blocks=st.integers(12, 40),
       block_size=st.sampled_from([1, 2, 4, 16]), budget=st.integers(1, 64), max_seqs=st.integers(1, 8),
       prefix_caching=st.booleans(), window=st.sampled_from([None, 1, 5, 16]),
       policy=st.sampled_from(["priority", "fcfs"]))
def test_random_workloads_finish_without_leaks_or_wrong_kv(specs, num_blocks, block_size, budget, max_seqs,
                                                           prefix_caching, window, policy):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy), kv)
    sim = Simulator(kv, sched)
    pending = list(specs)
    live: list[Sequence] = []
    step = 0
    while pending or sched.has_work():
        step += 1
        assert step < 5000, "no progress"
        if pending and step % 2:  # arrivals interleave with steps
            shared, tail, out_len, n, abort, abort_at, salt, priority = pending.pop(0)
            prompt = (PREFIXES[shared] if shared < len(PREFIXES) else []) + tail
            if kv.blocks_needed(len(prompt) + out_len) > num_blocks:
                continue  # the engine rejects these at admission
            # Three clients, so seats also move between them (the scheduler's fairness rule).
            req = Request(str(step), None, prompt, SamplingParams(n=n), out_len, cache_salt=salt,
                          client=f"c{len(pending) % 3}", priority=priority)
            req.abort_at = abort_at if abort else None  # type: ignore[attr-defined]
            seq = sim.new_seq(req, prompt, 0)
            sched.add(seq)
            live.append(seq)
        # Outputs depend on the sequence only, as greedy decoding would.
        sim.step(lambda s: (sum(s.token_ids) * 31 + s.index) % 50)
        for seq in list(live):
            for s in seq.request.seqs:
                if seq.request.abort_at is not None and step >= seq.request.abort_at and not s.finished:
                    sched.finish(s)
        live = [s for s in live if not all(x.finished for x in s.request.seqs)]
        check_invariants(kv)
    assert kv.pool.num_free == num_blocks, "blocks leaked"
    assert not kv.block_tables


def test_prefix_hit_reuses_blocks_and_salt_isolates():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1000), kv)
    sim = Simulator(kv, sched)
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks

    def run(salt: str | None) -> int:
        req = Request("r", None, prompt, SamplingParams(), 2, cache_salt=salt)
        sched.add(sim.new_seq(req, prompt, 0))
        first = sched.schedule()
        cached = first.seqs[0].num_cached_tokens
        assert first.num_scheduled == [len(prompt) - cached]
        first.seqs[0].num_computed_tokens += first.num_scheduled[0]
        kv.cache_full_blocks(first.seqs[0].seq_id, prompt, len(prompt), salt)
        sched.finish(first.seqs[0])
        return cached

    assert run(None) == 0
    assert run(None) == 20          # all 5 full blocks hit
    assert run("tenant-a") == 0     # another salt sees nothing
    assert run("tenant-a") == 20
    assert kv.stats.hits == 40 and kv.stats.queries == 4 * 21
    kv.reset_prefix_cache()
    assert run(None) == 0


def test_full_hit_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), kv)
    prompt = list(range(8))  # exactly two full blocks
    for expected_cached in (0, 4):
        req = Request("r", None, prompt, SamplingParams(), 1)
        seq = Sequence(len(req.seqs) + expected_cached, req, 0, list(prompt), len(prompt))
        req.seqs.append(seq)
        sched.add(seq)
        out = sched.schedule()
        assert seq.num_cached_tokens == expected_cached
        assert out.num_scheduled == [8 - expected_cached]
        seq.num_computed_tokens = 8
        kv.cache_full_blocks(seq.seq_id, prompt, 8, None)
        sched.finish(seq)


def test_no_request_starves_under_steady_kv_pressure():
    """A closed loop of short requests through a pool that preempts every few steps (the disconnect soak's
    shape): a preempted sequence keeps its age, so it is neither the next victim once readmitted nor left
    behind younger waiters, and no request waits much longer than a long one takes under sharing."""
    rng = random.Random(5)
    seats, num_blocks, num_requests = 16, 34, 200
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=512), kv)
    sim = Simulator(kv, sched)
    started: dict[Sequence, int] = {}
    waited: list[int] = []
    step = 0
    while len(waited) < num_requests:
        step += 1
        assert step < 10_000, "no progress"
        while len(started) < seats and len(waited) + len(started) < num_requests:
            prompt = [rng.randrange(3, 40_000) for _ in range(rng.randint(15, 30))]
            req = Request(str(step), None, prompt, SamplingParams(), rng.randint(16, 80), client="one")
            seq = sim.new_seq(req, prompt, 0)
            sched.add(seq)
            started[seq] = step
        for seq in sim.step(lambda s: sum(s.token_ids) * 31 % 50_000):
            waited.append(step - started.pop(seq))
    assert sched.num_preemptions > num_requests // 4, "the pool is meant to preempt"
    # The pool holds about seven of the sixteen at once, each up to 80 tokens: a fair queue keeps the worst wait
    # to a few request lengths. Preempting the readmitted sequence again and again, readmitting the most recently
    # preempted first, or letting short prompts take the blocks a long recomputation waits for made it most of
    # the run.
    assert max(waited) < 400, sorted(waited)[-5:]
