"""Drafting with a one-layer head over the target's own hidden states, as chains or draft trees: an EAGLE-3 head
(eagle3_head.py) or a checkpoint's MTP layer (mtp.py), both a DraftHead.

The target's forward keeps the states the head reads at every token, in the same pass: the residual stream
entering three of its layers for EAGLE-3 (LlamaForCausalLM.aux_layers), its normed output for MTP (aux_output).
After each step, once the scheduler has rolled rejected tokens back, each sequence keeps the states of the
positions that became valid. When it next drafts, the head first catches up over them: at position p it reads
the target's states at p and the token at p + 1, writing its one layer's KV into a small pool beside the
target's. The last of these rows predicts the first draft; each further draft is one pass over the head's own
previous state and draft token. A chain's KV (positions past the target's) is speculative, and the next catch-up
writes over it with what the target verified. A sequence that does not draft (the adaptive controller finds it
does not pay, as in large batches) costs the head nothing.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagoda.core.draft_tree import TokenTree, mask_word
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Sequence
from pagoda.core.scheduler import SchedulerOutput
from pagoda.executor.model_runner import FlatBatch
from pagoda.kernels.paged_attention import AttentionMetadata

_CPU = torch.device("cpu")
# Target states a sequence keeps for its next catch-up. Past this the oldest are dropped, and the head starts
# over after them with less context (its drafts stay exact: only their acceptance can suffer).
MAX_PENDING = 1024


@dataclass
class _SeqState:
    base: int                           # the position of the draft pool's first slot for this sequence
    computed: int                       # positions base..computed-1 hold KV from the target's own states
    # The target's states for positions computed.. not yet caught up: (a step's aux tensor, first row, rows).
    pending: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    num_pending: int = 0
    state: torch.Tensor | None = None   # the head's output at computed - 1 once caught up to num_tokens - 1:
                                        # its logits are the first draft

    @property
    def end(self) -> int:
        """The first position whose target states this sequence does not have yet."""
        return self.computed + self.num_pending


class DraftHead(Protocol):
    """What the proposer needs of a head (Eagle3Head, MtpHead)."""

    hidden_size: int
    draft_vocab_size: int  # the rows of its logits (d2t maps them to the target's ids)

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, input_ids: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, from_target: bool) -> torch.Tensor: ...

    def logits(self, state: torch.Tensor) -> torch.Tensor: ...

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def allocate_kv(self, num_blocks: int, block_size: int) -> None: ...


class HeadProposer:
    def __init__(self, head: DraftHead, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.head = head
        self.block_size = block_size
        self.vocab_size = vocab_size
        head.allocate_kv(num_blocks, block_size)
        self.draft_kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[int, _SeqState] = {}
        self.target_ids = head.to_target(torch.arange(head.draft_vocab_size))  # draft id -> target id
        self.target_list: list[int] = self.target_ids.tolist()  # the same, read one id at a time

    # ---- bookkeeping -----------------------------------------------------------------------------
    def release_except(self, live: set[int]) -> None:
        for seq_id in [s for s in self.seqs if s not in live]:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.draft_kv.free(seq_id)

    def _restart(self, seq_id: int, position: int) -> _SeqState:
        self._drop(seq_id)
        st = self.seqs[seq_id] = _SeqState(base=position, computed=position)
        return st

    # ---- after the step --------------------------------------------------------------------------
    def record(self, sched: SchedulerOutput, rejected: Mapping[int, int], aux: torch.Tensor | None,
               tree_paths: Mapping[Sequence, list[int]] | None = None) -> None:
        """After Scheduler.update: keep each row's target states at the positions the step made valid (the
        row's scheduled tokens less `rejected[row]`, as the scheduler counted them). A verified draft tree's
        are the root's and its accepted nodes' (`tree_paths`: their indices among the proposals)."""
        if aux is None:
            return
        offset = 0
        for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled)):
            off, offset = offset, offset + n
            valid = n - rejected.get(row, 0)
            if seq.finished or valid <= 0:
                continue
            start = seq.num_computed_tokens - valid
            st = self.seqs.get(seq.seq_id)
            if st is None or st.end != start:  # new, preempted, or a prefix hit skipped positions
                st = self._restart(seq.seq_id, start)
            path = tree_paths.get(seq) if tree_paths else None
            if path is not None:  # the root (first) and the accepted nodes, gathered in position order
                st.pending.append((aux[torch.tensor([off] + [off + 1 + a for a in path[:valid - 1]])], 0, valid))
            else:
                st.pending.append((aux, off, valid))
            st.num_pending += valid
            st.state = None
            if st.num_pending > MAX_PENDING:
                self._keep_last(seq.seq_id, st)

    def _keep_last(self, seq_id: int, st: _SeqState) -> None:
        """Drop the oldest pending states beyond MAX_PENDING: the head starts over after them."""
        pending, end = st.pending, st.end
        st = self._restart(seq_id, end - MAX_PENDING)
        keep = MAX_PENDING
        for aux, off, n in reversed(pending):
            take = min(n, keep)
            st.pending.insert(0, (aux, off + n - take, take))
            keep -= take
            if not keep:
                break
        st.num_pending = MAX_PENDING

    @torch.inference_mode()
    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Run the head over each sequence's pending positions, in one batch, keeping the last row's output
        where the sequence has caught up to its last token."""
        batch = FlatBatch(self.block_size)
        positions: list[int] = []
        chunks: list[torch.Tensor] = []
        ends: list[tuple[_SeqState, int]] = []
        for seq in seqs:
            st = self.seqs.get(seq.seq_id)
            if st is None or not st.num_pending:
                continue
            start, end = st.computed, st.end
            if not self.draft_kv.allocate_slots(seq.seq_id, start - st.base, end - start):
                self._drop(seq.seq_id)
                continue
            batch.add(seq.token_ids[start + 1:end + 1], start - st.base, self.draft_kv.block_tables[seq.seq_id])
            positions.extend(range(start, end))
            chunks += [aux[off:off + n] for aux, off, n in st.pending]
            st.computed, st.pending, st.num_pending = end, [], 0
            if end == seq.num_tokens - 1:
                ends.append((st, len(positions) - 1))
        if not positions:
            return
        out = self._run(batch, positions, torch.cat(chunks), from_target=True)
        if ends:
            last = out[torch.tensor([row for _, row in ends])]
            for i, (st, _) in enumerate(ends):
                st.state = last[i]

    # ---- drafting --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], trees: list[TokenTree | None] | None = None,
                ) -> tuple[list[list[int]], list[torch.Tensor | None], list[list[int]]]:
        """Per sequence, a chain of up to ks[i] tokens, or where trees[i] is given that draft tree cut ks[i] deep
        (core/draft_tree.py): each node the head's top token of its rank below its parent (a point mass,
        verified as such: spec_decode/rejection.py). Returns the proposals in the tree's flat order, q ([k, V])
        for chains that sample (None for greedy rows and trees), and each tree's parents (empty for a chain)."""
        shapes = [(t.cut(k) if t is not None else TokenTree.chain(k)) if k > 0 else None
                  for t, k in zip(trees or [None] * len(seqs), ks)]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        parents: list[list[int]] = [[] for _ in seqs]
        live: list[int] = []
        self._catch_up([seq for seq, k in zip(seqs, ks) if k > 0])
        inner: dict[int, set[tuple[int, ...]]] = {}  # per live row, the nodes it runs the head over
        for i, (seq, shape) in enumerate(zip(seqs, shapes)):
            st = self.seqs.get(seq.seq_id)
            if shape is None or st is None or st.state is None or st.computed != seq.num_tokens - 1:
                continue
            inner[i] = set(shape.inner())
            if inner[i] and not self.draft_kv.allocate_slots(seq.seq_id, st.computed - st.base, len(inner[i])):
                self._drop(seq.seq_id)
                continue
            live.append(i)
        if not live:
            return drafts, [None] * len(seqs), parents
        head = self.head
        # Per live row: the head's output (state) and logits at each node run so far, the root's first.
        states = {i: {(): self.seqs[seqs[i].seq_id].state} for i in live}
        logits = {i: {(): row} for i, row in zip(live, head.logits(torch.stack([states[i][()] for i in live])))}
        tokens: dict[int, dict[tuple[int, ...], int]] = {i: {} for i in live}
        slots: dict[int, dict[tuple[int, ...], int]] = {i: {} for i in live}  # inner nodes' draft-pool slots
        for depth in range(1, max(shapes[i].depth for i in live) + 1):  # type: ignore[union-attr]
            batch = FlatBatch(self.block_size)
            positions: list[int] = []
            run: list[tuple[int, tuple[int, ...]]] = []
            for i in live:
                shape, st, seq = shapes[i], self.seqs[seqs[i].seq_id], seqs[i]
                assert shape is not None
                level = [p for p in shape.paths if len(p) == depth]
                if trees and trees[i] is not None:  # a tree: each node the token of its rank below its parent
                    ranks: dict[tuple[int, ...], int] = {}
                    for p in level:
                        ranks[p[:-1]] = max(ranks.get(p[:-1], 0), p[-1] + 1)
                    # one ranking per parent: its children are distinct tokens even where the head's logits tie
                    ranked = {q: [self.target_list[d] for d in logits[i][q].topk(n).indices.tolist()]
                              for q, n in ranks.items()}
                    for p in level:
                        tokens[i][p] = ranked[p[:-1]][p[-1]]
                else:  # a chain: the head's choice, or its draw for a sampled row
                    for p in level:
                        tokens[i][p], q = self._sample(logits[i][p[:-1]], seq)
                        if q is not None:
                            qs[i].append(q)
                run_here = [p for p in level if p in inner[i]]
                if not run_here:
                    continue
                for p in run_here:
                    slots[i][p] = st.computed + len(slots[i])  # inner nodes take the next slots, in flat order
                # Consecutive slots: one row; a node sees the caught-up context, its ancestors and itself.
                first = slots[i][run_here[0]] - st.base
                words = None
                if len(inner[i]) > shape.depth - 1:  # inner nodes that are not a chain: mask the other branches
                    words = [mask_word([slots[i][p[:j]] - st.base for j in range(1, depth + 1)],
                                       st.computed - st.base, first + len(run_here)) for p in run_here]
                here = [st.computed - 1 + depth] * len(run_here)  # the position of their depth
                batch.add([tokens[i][p] for p in run_here], first, self.draft_kv.block_tables[seq.seq_id], here, words)
                positions += here
                run += [(i, p) for p in run_here]
            if not run:
                break
            inputs = torch.stack([states[i][p[:-1]] for i, p in run])
            out = self._run(batch, positions, inputs, from_target=False)
            for (i, p), state, row in zip(run, out, head.logits(out)):
                states[i][p], logits[i][p] = state, row
        for i in live:
            shape = shapes[i]
            assert shape is not None
            drafts[i] = [tokens[i][p] for p in shape.paths]
            if trees and trees[i] is not None:
                parents[i] = shape.parents
        return drafts, [torch.stack(q) if q else None for q in qs], parents

    def _run(self, batch: FlatBatch, positions: list[int], state: torch.Tensor, from_target: bool) -> torch.Tensor:
        """One head pass over `batch` (laid out in the draft pool) at RoPE `positions`."""
        return self.head(torch.tensor(batch.input_ids), state, torch.tensor(positions), batch.metadata(_CPU),
                         from_target)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        """A draft-vocabulary row -> (target token, q over the target vocabulary, None for greedy rows)."""
        p = seq.request.params
        if p.greedy:
            return self.target_list[int(logits.argmax())], None
        q_draft = (logits / p.temperature).softmax(dim=-1)
        d = torch.multinomial(q_draft, 1, generator=seq.generator)[0]
        q = torch.zeros(self.vocab_size)
        q[self.target_ids] = q_draft
        return self.target_list[int(d)], q

    def calibrate(self, reps: int = 5) -> tuple[float, float]:
        """Seconds of one chain pass over 1 and over 8 rows (best of `reps`), in blocks all free at start-up."""
        h = self.head.hidden_size
        dtype = self.head.dtype
        best = [float("inf"), float("inf")]
        for rep in range(reps + 1):
            for i, rows in enumerate((1, 8)):
                batch = FlatBatch(self.block_size)
                for r in range(rows):
                    batch.add([0], 0, [r])
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self.head.logits(self._run(batch, [0] * rows, torch.zeros(rows, h, dtype=dtype), False))
                if rep:
                    best[i] = min(best[i], time.perf_counter() - t0)
        return best[0], best[1]
