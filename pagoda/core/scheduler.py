"""Scheduler: continuous batching with one rule for the budget and one for fairness.

Every running sequence is scheduled for the tokens it still needs (num_tokens - num_computed_tokens, plus
any speculative proposals to verify), within a per-step token budget and a sequence cap. A decode needs one
token; a prompt gets a chunk. That yields chunked prefill and mixed prefill/decode steps, as in vLLM v1. When
the pool runs dry, the youngest running sequence (of the highest rank, below) is preempted (KV dropped, recomputed
later). A sequence keeps its age (`Sequence.arrival_order`) through preemption: it goes back to the waiting queue
ahead of everything younger, rejoins `running` in its place, and younger newcomers never take the blocks it waits
for, so under steady pressure the oldest sequence always progresses and none starves.

Fairness (core/fairness.py): the budget goes to decodes first, then to prompts, those under way and new ones
together, shortest remaining first: a short prompt gets its first token within a step or two however long
the prompts around it are, and a burst of prompts finishes them one after another rather than all at once.
Seats go to the client holding fewest (then, within a client, the request): while someone waits and the
seats are full, a client or request holding two more seats than the waiter yields its youngest one. One client,
or one request's `n`, can hold every seat only while nobody else wants one.

Priority (`--scheduling-policy priority`, vLLM's rule): a sequence's rank is its request's priority, lower
first (under fcfs every rank is 0 and nothing below changes). Ranks stand above everything else: the waiting
queue serves the lowest rank first, `running` is kept in rank order so decodes are served and victims taken
from its end (the youngest of the highest rank), and a waiter of a lower rank than the last running sequence
takes its seat, and its blocks, when either is short. A step that computes a prompt computes nothing of a
higher rank beside it: a request's first token never waits on lower priorities' steps.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.core.fairness import Seats, WaitingQueue, client_of
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import SeqStatus, Sequence


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)  # tokens per scheduled sequence
    preempted: list[Sequence] = field(default_factory=list)  # for want of KV blocks
    yielded: list[Sequence] = field(default_factory=list)    # seats handed to a fairer waiter
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled.append(num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(self.rank)
        self.running: list[Sequence] = []  # in rank order, then in arrival order
        self.num_preemptions = 0

    def rank(self, seq: Sequence) -> int:
        """Who is served first: a lower rank. The request's priority under the priority policy, else 0."""
        return seq.request.priority if self.config.policy == "priority" else 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling joins right behind its parent's KV (it shares the parent's blocks)."""
        seq.status = SeqStatus.RUNNING
        self._run(seq)

    def _run(self, seq: Sequence) -> None:
        """Join `running` in its place: behind every sequence of a lower rank or of its rank and older. A
        readmitted sequence keeps its age, so preemption takes the youngest and never the same old one again."""
        key = lambda s: (self.rank(s), s.arrival_order)  # noqa: E731
        self.running.insert(bisect.bisect_right(self.running, key(seq), key=key), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        seats = Seats.of(self.running)
        self._yield_seats(seats, out)
        budget = self.config.max_num_batched_tokens
        cutoff = self._prompt_rank(seats)

        # 1) Decodes, oldest first; prompts under way wait for step 2.
        prefilling: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_computed_tokens < seq.num_tokens - 1:
                prefilling.append(seq)
                i += 1
                continue
            if self.rank(seq) > cutoff:  # `running` is in rank order: the rest sit this step out
                break
            # Proposals to verify count like tokens (vLLM v1's num_tokens_with_spec); the budget may trim them.
            num_new = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            del seq.spec_token_ids[max(0, seq.num_computed_tokens + num_new - seq.num_tokens):]
            del seq.spec_parents[len(seq.spec_token_ids):]  # a tree cut in flat order is still a tree
            if num_new <= 0:  # nothing to do (should not happen: finished seqs leave at once)
                i += 1
                continue
            # Victims come from the end: never a sequence already scheduled or set aside above.
            if not self._allocate_or_preempt(seq, num_new, out, seats):
                break  # seq itself was preempted: it was the youngest, nothing after it
            out.add(seq, num_new)
            budget -= num_new
            i += 1

        # 2) Prompts: those under way and the waiting ones the free seats go to (fairest first; never past a
        # preemption for want of blocks), by rank, then shortest remaining first, so a short prompt's first
        # token never waits behind a long one, and a prompt cut by the last step's budget finishes before new
        # ones start.
        newcomers: list[Sequence] = []
        while not out.preempted and len(self.running) + len(newcomers) < self.config.max_num_seqs:
            seq = self.waiting.fairest(seats)
            if seq is None:
                break
            self.waiting.remove(seq)
            seats.take(seq)
            newcomers.append(seq)
        admitting = bool(newcomers)
        need = {seq: self._first_chunk_blocks(seq) for seq in newcomers}
        for seq in sorted(prefilling + newcomers,
                          key=lambda s: (self.rank(s), s.num_tokens - s.num_computed_tokens, s.seq_id)):
            if budget <= 0 or self.rank(seq) > cutoff:
                break
            if seq.status is SeqStatus.RUNNING:  # under way
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if out.seqs:
                    # Blocks are short and others progress: wait for theirs rather than preempt a scheduled row.
                    if not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new):
                        break
                elif not self._allocate_or_preempt(seq, num_new, out, seats):
                    continue
            elif seq.status is SeqStatus.PREEMPTED and seq in prefilling:
                continue  # preempted just now, for another's blocks
            else:
                if not admitting:
                    continue
                # Blocks are kept for the fairer newcomers not admitted yet (drawn before it): a long recomputation
                # would otherwise lose them to short prompts step after step, and wait for ever.
                reserve = sum(need[s] for s in newcomers[:newcomers.index(seq)])
                if self.kv.pool.num_free - need[seq] < reserve:
                    continue
                if not self._admit(seq, budget):
                    admitting = False  # out of blocks: the rest wait for the next step, in their order
                    continue
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                newcomers.remove(seq)
            out.add(seq, num_new)
            budget -= num_new
        for seq in newcomers:  # not admitted this step: back to their places in the queue
            seats.give(seq)
            self.waiting.push(seq)
        out.block_copies = self.kv.take_copies()
        return out

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """A waiting sequence takes its cached prefix and slots for its first chunk and starts running; False
        (nothing held) where the pool cannot give them."""
        num_cached = self._acquire_cached_prefix(seq)
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new):
            if num_cached:  # give the cached blocks back; retried next step
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
            return False
        if seq.num_preemptions == 0 and self.kv.enable_prefix_caching:
            # Count first admissions only, so recomputation after preemption does not skew the rate.
            self.kv.stats.queries += seq.num_tokens
            self.kv.stats.hits += num_cached
            seq.num_cached_tokens = num_cached
        seq.status = SeqStatus.RUNNING
        self._run(seq)
        return True

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput, seats: Seats) -> bool:
        """Slots for `num_new` tokens of `seq`, preempting the youngest running sequences until they fit;
        False where `seq` itself had to go."""
        while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new):
            victim = self.running.pop()  # the youngest
            seats.give(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _yield_seats(self, seats: Seats, out: SchedulerOutput) -> None:
        """Seats (and blocks) handed to the fairest waiter, one sequence per round, back to waiting (its KV is
        recomputed, from the prefix cache where it can): the youngest running sequence of a higher rank than the
        waiter's when the seats are full or the pool cannot hold the waiter's first chunk; else, with the
        seats full, the youngest of the group holding two more seats than the waiter's, in the waiter's rank,
        so the gap narrows and never swings back."""
        full = lambda: len(self.running) >= self.config.max_num_seqs  # noqa: E731
        while self.running and (waiter := self.waiting.fairest(seats)) is not None:
            rank = self.rank(waiter)
            if self.rank(self.running[-1]) > rank and (full() or not self._fits(waiter)):
                holder = self.running[-1]
            elif full():
                peers = [s for s in reversed(self.running) if self.rank(s) == rank]
                if not peers:
                    return
                holder = max(peers, key=lambda s: (seats.by_client[client_of(s)],
                                                   seats.by_request[s.request.request_id]))
                if not seats.owes(holder, waiter):
                    return
            else:
                return
            self.running.remove(holder)
            seats.give(holder)
            self._preempt(holder)
            out.yielded.append(holder)

    def _prompt_rank(self, seats: Seats) -> float:
        """The lowest rank of a prompt to compute this step (one under way, or the waiter the next free seat
        goes to); nothing of a higher rank is scheduled beside it, so a prompt's first token never waits on
        the steps of lower priorities. Infinite where no prompt waits, and under fcfs (one rank for all)."""
        if self.config.policy != "priority":
            return float("inf")
        ranks = [self.rank(s) for s in self.running if s.num_computed_tokens < s.num_tokens - 1]
        waiter = self.waiting.fairest(seats) if len(self.running) < self.config.max_num_seqs else None
        if waiter is not None:
            ranks.append(self.rank(waiter))
        return min(ranks, default=float("inf"))

    def _first_chunk_blocks(self, seq: Sequence) -> int:
        """Blocks a waiting sequence's first chunk takes (cached prefix blocks not counted)."""
        return self.kv.blocks_needed(min(seq.num_tokens - seq.num_computed_tokens, self.config.max_num_batched_tokens))

    def _fits(self, seq: Sequence) -> bool:
        """Whether the free blocks hold `seq`'s first chunk."""
        return self.kv.pool.num_free >= self._first_chunk_blocks(seq)

    def _acquire_cached_prefix(self, seq: Sequence) -> int:
        """Reuse cached KV for a sequence that has none yet (new, or preempted and recomputing)."""
        req = seq.request
        if seq.num_computed_tokens or (req.prompt_logprobs is not None
                                       and len(req.prompt_logprobs) < len(req.prompt_token_ids)):
            return 0  # prompt logprobs still owed need the logits of those prompt positions
        seq.num_computed_tokens = self.kv.acquire_cached_prefix(seq.seq_id, seq.token_ids, seq.request.cache_salt,
                                                                  seq.request.lora_key)
        return seq.num_computed_tokens

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV; it is recomputed (prompt + output so far) when readmitted."""
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()
        seq.spec_parents.clear()
        seq.status = SeqStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)

    def update_draft_token_ids(self, drafts: Mapping[Sequence, list[int]],
                               trees: Mapping[Sequence, list[int]] | None = None) -> None:
        """The speculator's proposals for the next step (vLLM v1's update_draft_token_ids), and the parents of
        those that form a tree (core/draft_tree.py): schedule() counts them in its token budget, trims what does
        not fit and allocates their slots; update() clears them."""
        for seq in self.running:
            seq.spec_token_ids = list(drafts.get(seq, ()))
            seq.spec_parents = list(trees.get(seq, ())) if trees else []

    def queued_prompt_tokens(self) -> int:
        """Tokens of prompts (or recomputations) not computed yet: the waiting sequences' and those under way."""
        return sum(s.num_tokens for s in self.waiting) + \
            sum(s.num_tokens - s.num_computed_tokens for s in self.running if s.num_computed_tokens < s.num_tokens - 1)

    def update(self, sched: SchedulerOutput, num_rejected: Mapping[int, int]) -> None:
        """After the step's tokens are appended (vLLM v1's update_from_output): each scheduled row has KV
        for the tokens it was scheduled less those rejected (`num_rejected[row]`: proposals it did not
        accept, or did not append after a stop), and its full blocks join the prefix cache. A row frees the blocks
        past its computed tokens (rejected slots, a self draft's slots the budget did not verify); with a sliding
        window, blocks out of every later query's window are freed. Finished sequences leave and free their
        blocks."""
        for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled)):
            if seq.finished:  # failed or aborted during the step
                continue
            rejected = num_rejected.get(row)
            seq.num_computed_tokens += n - (rejected or 0)
            seq.spec_token_ids, seq.spec_parents = [], []
            self.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.request.cache_salt,
                                         seq.request.lora_key)
            self.kv.trim(seq.seq_id, seq.num_computed_tokens)
            self.kv.release_out_of_window(seq.seq_id, seq.num_computed_tokens)
        for seq in list(self.running):
            if seq.finish_reason is not None:
                self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
