"""The priority policy: lower `priority` first in the waiting queue, and a waiter of higher priority takes the
seat or the KV blocks of the newest running sequence of lower priority (vLLM's rule); fcfs ignores it."""
from __future__ import annotations

from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from tests.test_scheduler_fairness import make, run
from tests.test_scheduler_fairness import scheduler as _scheduler


def scheduler(policy: str, max_seqs: int = 4, blocks: int = 256) -> Scheduler:
    return _scheduler(max_seqs, 64, blocks, policy)


def fill(sched: Scheduler, count: int, priority: int) -> list[Request]:
    reqs = [make(8, client=f"bulk{i}", priority=priority) for i in range(count)]
    for r in reqs:
        sched.add(r.seqs[0])
    run(sched, 2)
    return reqs


def test_a_higher_priority_waiter_takes_the_newest_lower_priority_seat():
    sched = scheduler("priority")
    bulk = fill(sched, 4, priority=10)
    urgent = make(8, priority=0)
    sched.add(urgent.seqs[0])
    out = sched.schedule()
    assert out.yielded == [bulk[3].seqs[0]]
    assert urgent.seqs[0] in out.seqs and out.num_scheduled[out.seqs.index(urgent.seqs[0])] == 8
    assert sched.running[0] is urgent.seqs[0]  # served first from now on


def test_a_lower_priority_waiter_never_takes_a_seat():
    sched = scheduler("priority")
    fill(sched, 4, priority=0)
    late = make(8, priority=5, client="other")
    sched.add(late.seqs[0])
    run(sched, 3)
    assert sched.num_preemptions == 0 and late.seqs[0] in sched.waiting


def test_a_higher_priority_waiter_takes_blocks_when_the_pool_is_short():
    sched = scheduler("priority", max_seqs=8, blocks=10)  # 4 tokens a block
    bulk = fill(sched, 3, priority=1)  # 3 blocks each (10 tokens): one block left, the newcomer needs 2
    assert sched.num_preemptions == 0 and sched.kv.pool.num_free == 1
    urgent = make(8, priority=0)
    sched.add(urgent.seqs[0])
    out = sched.schedule()
    assert bulk[2].seqs[0] in out.yielded and urgent.seqs[0] in out.seqs


def test_the_waiting_queue_serves_lower_priority_values_first():
    sched = scheduler("priority", max_seqs=1)
    low, high = make(8, priority=3), make(8, priority=-1)
    sched.add(low.seqs[0])
    sched.add(high.seqs[0])
    out = sched.schedule()
    assert out.seqs == [high.seqs[0]]


def test_fcfs_ignores_priority():
    sched = scheduler("fcfs")
    fill(sched, 4, priority=10)
    urgent = make(8, priority=0)
    sched.add(urgent.seqs[0])
    out = sched.schedule()
    assert not out.yielded and urgent.seqs[0] not in out.seqs
    sched = scheduler("fcfs", max_seqs=1)
    low, high = make(8, priority=3), make(8, priority=-1)
    sched.add(low.seqs[0])
    sched.add(high.seqs[0])
    assert sched.schedule().seqs == [low.seqs[0]]


def test_a_higher_priority_prompt_computes_alone_and_the_others_resume_after():
    sched = scheduler("priority", max_seqs=8)
    bulk = fill(sched, 3, priority=10)
    urgent = make(8, priority=0)
    sched.add(urgent.seqs[0])
    out = sched.schedule()
    assert out.seqs == [urgent.seqs[0]] and not out.yielded  # the decodes of priority 10 sit this step out
    run(sched)
    out = sched.schedule()  # its prompt is done: everyone decodes together again
    assert out.seqs == [urgent.seqs[0], *(r.seqs[0] for r in bulk)] and out.num_scheduled == [1] * 4
