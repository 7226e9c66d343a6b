"""The scheduler's fairness rule: decodes before prompts, prompts shortest remaining first, and seats shared
between clients and between requests (core/fairness.py)."""
from __future__ import annotations

import itertools

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, Sequence
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams

_ids = itertools.count()


def make(prompt_len: int, client: str | None = None, n: int = 1, priority: int = 0) -> Request:
    req = Request(f"r{next(_ids)}", None, list(range(1, prompt_len + 1)), SamplingParams(n=n), 64, client=client,
                  priority=priority)
    for i in range(n):
        req.seqs.append(Sequence(next(_ids), req, i, list(req.prompt_token_ids), prompt_len))
    return req


def scheduler(max_seqs: int, budget: int, blocks: int = 256, policy: str = "priority") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy),
                     KVCacheManager(blocks, 4, enable_prefix_caching=False))


def run(sched: Scheduler, steps: int = 1) -> None:
    """Steps as the engine takes them: every scheduled token computed, a decode appends one token."""
    for _ in range(steps):
        out = sched.schedule()
        for seq, n in zip(out.seqs, out.num_scheduled):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)


def test_a_new_client_gets_a_seat_from_one_holding_them_all():
    sched = scheduler(max_seqs=4, budget=64)
    greedy = make(8, client="a", n=4)
    for seq in greedy.seqs:
        sched.add(seq)
    run(sched, 3)
    assert len(sched.running) == 4
    late = make(8, client="b")
    sched.add(late.seqs[0])
    out = sched.schedule()
    assert late.seqs[0] in out.seqs and out.num_scheduled[out.seqs.index(late.seqs[0])] == 8
    assert out.yielded == [greedy.seqs[3]]  # the newest of the greedy request
    assert sched.num_preemptions == 1 and len(sched.running) == 4


def test_requests_of_one_client_share_its_seats():
    sched = scheduler(max_seqs=4, budget=64)
    big = make(8, client="same", n=4)
    for seq in big.seqs:
        sched.add(seq)
    run(sched, 2)
    small = make(8, client="same")
    sched.add(small.seqs[0])
    out = sched.schedule()
    assert small.seqs[0] in out.seqs and len(out.yielded) == 1


def test_seats_move_only_while_the_gap_is_two_or_more():
    sched = scheduler(max_seqs=3, budget=64)
    a, b = make(8, client="a", n=2), make(8, client="b")
    for seq in a.seqs + b.seqs:
        sched.add(seq)
    run(sched, 2)
    c = make(8, client="b")
    sched.add(c.seqs[0])
    run(sched, 4)  # b holds 1 and a 2: handing a seat over would only swap who is ahead
    assert sched.num_preemptions == 0 and c.seqs[0] in sched.waiting


def test_decodes_go_before_a_long_prompt_under_way():
    sched = scheduler(max_seqs=4, budget=64, blocks=1024)
    long = make(1000)
    sched.add(long.seqs[0])
    run(sched, 1)
    short = make(4)
    sched.add(short.seqs[0])
    run(sched, 1)  # short is decoding now, long still prefilling, and long is the older
    assert short.seqs[0].num_computed_tokens == 4 and long.seqs[0].num_computed_tokens < 1000
    out = sched.schedule()
    assert out.seqs[0] is short.seqs[0] and out.num_scheduled[0] == 1
    assert out.seqs[1] is long.seqs[0] and out.num_scheduled[1] == 63


def test_a_new_prompt_goes_before_a_long_one_under_way():
    sched = scheduler(max_seqs=4, budget=64, blocks=1024)
    long = make(1000)
    sched.add(long.seqs[0])
    run(sched, 2)
    short = make(10)
    sched.add(short.seqs[0])
    out = sched.schedule()
    assert out.seqs == [short.seqs[0], long.seqs[0]] and out.num_scheduled == [10, 54]


def test_prompts_go_shortest_remaining_first() -> None:
    sched = scheduler(max_seqs=4, budget=64, blocks=1024)
    first, second = make(1000), make(1000)
    sched.add(first.seqs[0])
    run(sched, 3)
    sched.add(second.seqs[0])
    out = sched.schedule()
    assert out.seqs == [first.seqs[0]]  # 808 left against 1000: the nearer end first
    short = make(40)
    sched.add(short.seqs[0])
    run(sched, 1)
    out = sched.schedule()
    assert short.seqs[0] in out.seqs and out.num_scheduled[out.seqs.index(short.seqs[0])] == 1  # decoding already
