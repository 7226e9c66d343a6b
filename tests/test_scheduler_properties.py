"""Property tests: the scheduler and KV cache manager never leak blocks or break their invariants."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.engine.request import Request, Sequence
from pagoda.sampling_params import SamplingParams


def check_invariants(kv: KVCacheManager) -> None:
    refs = Counter(b for table in kv.block_tables.values() for b in table)
    for b in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[b] == refs.get(b, 0), f"block {b} refcount mismatch"
        assert kv.pool.ref_counts[b] >= 0
    assert kv.pool.num_free == sum(1 for r in kv.pool.ref_counts if r == 0)
    assert len(set(kv.pool._free)) == kv.pool.num_free


request_spec = st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(1, 3), st.booleans(), st.integers(0, 20))


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=12), num_blocks=st.integers(12, 40),
       block_size=st.sampled_from([1, 2, 4, 16]), budget=st.integers(1, 64), max_seqs=st.integers(1, 8))
def test_random_workloads_finish_without_leaks(specs, num_blocks, block_size, budget, max_seqs):
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)
    ids = iter(range(10**6))
    pending = list(specs)
    live: list[Sequence] = []
    done: list[Sequence] = []
    step = 0
    while pending or sched.has_work():
        step += 1
        assert step < 5000, "no progress"
        if pending and step % 2:  # arrivals interleave with steps
            prompt_len, out_len, n, abort, abort_at = pending.pop(0)
            if kv.blocks_needed(prompt_len + out_len) > num_blocks:
                continue  # the engine rejects these at admission
            req = Request(str(step), None, list(range(prompt_len)), SamplingParams(n=n), out_len)
            seq = Sequence(next(ids), req, 0, list(range(prompt_len)), prompt_len)
            req.seqs.append(seq)
            req.abort_at = abort_at if abort else None  # type: ignore[attr-defined]
            sched.add(seq)
            live.append(seq)
        out = sched.schedule()
        check_invariants(kv)
        scheduled = set()
        for seq, n_tok in zip(out.seqs, out.num_scheduled):
            assert n_tok > 0 and seq.seq_id not in scheduled
            scheduled.add(seq.seq_id)
            assert len(kv.block_tables[seq.seq_id]) * block_size >= seq.num_computed_tokens + n_tok
            seq.num_computed_tokens += n_tok
        assert sum(out.num_scheduled) <= budget
        for seq in list(out.seqs):
            req = seq.request
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if seq.index == 0 and len(req.seqs) < req.params.n and seq.num_output_tokens == 0:
                for _ in range(req.params.n - 1):
                    child = Sequence(next(ids), req, len(req.seqs), list(seq.token_ids), seq.num_prompt_tokens)
                    child.num_computed_tokens = seq.num_computed_tokens
                    kv.fork(seq.seq_id, child.seq_id)
                    sched.add_running(child)
                    req.seqs.append(child)
                    live.append(child)
                    child.token_ids.append(7)
                    if child.num_output_tokens >= req.max_tokens:
                        sched.finish(child)
                        done.append(child)
            seq.token_ids.append(7)
            if seq.num_output_tokens >= req.max_tokens:
                sched.finish(seq)
                done.append(seq)
        for seq in list(live):
            if seq.request.abort_at is not None and step >= seq.request.abort_at and not seq.finished:
                sched.finish(seq)
                done.append(seq)
        live = [s for s in live if not s.finished]
        check_invariants(kv)
    assert kv.pool.num_free == num_blocks, "blocks leaked"
    assert not kv.block_tables
    for seq in done:
        assert seq.finished
