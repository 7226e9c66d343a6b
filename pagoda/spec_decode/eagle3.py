"""EAGLE-3 drafting: a one-layer head over the target's own hidden states (eagle3_head.py), chain drafts.

The target's forward keeps the residual stream entering three of its layers (LlamaForCausalLM.aux_layers) at
every token, in the same pass. After each step, once the scheduler has rolled rejected tokens back, each
sequence keeps the states of the positions that became valid. When it next drafts, the head first catches up
over them: at position p it reads the target's states at p and the token at p + 1, writing its one layer's KV
into a small pool beside the target's. The last of these rows predicts the first draft; each further draft is
one pass over the head's own previous state and draft token. A chain's KV (positions past the target's) is
speculative, and the next catch-up writes over it with what the target verified. A sequence that does not
draft (the adaptive controller finds it does not pay, as in large batches) costs the head nothing.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Sequence
from pagoda.core.scheduler import SchedulerOutput
from pagoda.executor.model_runner import FlatBatch
from pagoda.kernels.paged_attention import TREE_SPAN
from pagoda.spec_decode.eagle3_head import Eagle3Head

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


class Eagle3Proposer:
    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.head = head
        self.block_size = block_size
        self.vocab_size = vocab_size
        head.allocate_kv(num_blocks, block_size)
        self.draft_kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[int, _SeqState] = {}
        self.target_ids = head.to_target(torch.arange(head.config.draft_vocab_size))  # draft id -> target id

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
    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                ) -> tuple[list[list[int]], list[torch.Tensor | None], list[list[int]]]:
        """Up to ks[i] tokens deep per sequence: a chain, or where widths[i] > 1 a tree (core/draft_tree.py) of
        the head's top widths[i] first tokens, each followed by its own chain of the head's top tokens (point
        masses, verified as such: spec_decode/rejection.py). Returns the proposals in flat order (depth by depth,
        branch by branch), q ([k, V]) for chains that sample (None for greedy rows and trees), and each tree's
        parents (empty for a chain)."""
        vocab = self.head.config.draft_vocab_size  # a tree's first level cannot be wider
        widths = [min(w, vocab) for w in widths] if widths else [1] * len(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        live: list[int] = []
        self._catch_up([seq for seq, k in zip(seqs, ks) if k > 0])
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self.seqs.get(seq.seq_id)
            if k <= 0 or st is None or st.state is None or st.computed != seq.num_tokens - 1:
                continue
            if k > 1 and not self.draft_kv.allocate_slots(seq.seq_id, st.computed - st.base, widths[i] * (k - 1)):
                self._drop(seq.seq_id)
                continue
            live.append(i)
        trees: list[list[int]] = [[] for _ in seqs]
        if not live:
            return drafts, [None] * len(seqs), trees
        head = self.head
        # Each live row's tips: the states its next tokens are drafted from (first the root's, then a branch's each).
        tips = {i: self.seqs[seqs[i].seq_id].state.unsqueeze(0) for i in live}  # type: ignore[union-attr]
        logits = head.logits(torch.cat(list(tips.values())))
        depth = 0
        while True:
            at = 0
            for i in live:
                w, n = widths[i], tips[i].shape[0]
                rows, at = logits[at:at + n], at + n
                if depth == 0 and w > 1:  # a tree's first level: the head's top w
                    tokens = [int(t) for t in self.target_ids[rows[0].topk(w).indices]]
                    trees[i] += [-1] * w
                elif w > 1:  # each branch's next node, below its tip: the head's top token (a point mass)
                    tokens = [int(t) for t in self.target_ids[rows.argmax(dim=-1)]]
                    trees[i] += [len(drafts[i]) - w + b for b in range(w)]
                else:
                    token, q = self._sample(rows[0], seqs[i])
                    tokens = [token]
                    if q is not None:
                        qs[i].append(q)
                drafts[i] += tokens
            depth += 1
            live = [i for i in live if ks[i] > depth]
            if not live:
                break
            batch = FlatBatch(self.block_size)
            positions: list[int] = []
            for i in live:
                st, w = self.seqs[seqs[i].seq_id], widths[i]
                first = st.computed + (depth - 1) * w  # this depth's nodes take the next w slots, branch by branch
                batch.add(drafts[i][-w:], first - st.base, self.draft_kv.block_tables[seqs[i].seq_id])
                positions += [st.computed - 1 + depth] * w  # the position of their depth
                if w > 1:
                    self._mask_branches(batch, st, depth, w)
            inputs = [tips[i].expand(widths[i], -1) for i in live]  # the first level's nodes share the root's
            out = self._run(batch, positions, torch.cat(inputs), from_target=False)
            tips = dict(zip(live, out.split([widths[i] for i in live])))
            logits = head.logits(out)
        return drafts, [torch.stack(q) if q else None for q in qs], trees

    @staticmethod
    def _mask_branches(batch: FlatBatch, st: _SeqState, depth: int, w: int) -> None:
        """The tree mask of the row just added (a depth's w nodes, branch by branch, at the end of the head's
        slots): each sees the caught-up context and its own branch."""
        end = st.computed + depth * w - st.base  # the row's seq_len in the draft pool
        base = end - TREE_SPAN
        context = sum(1 << (key - base) for key in range(max(0, base), st.computed - st.base))
        words = []
        for b in range(w):
            bits = context
            for d in range(depth):
                bits |= 1 << (st.computed - st.base + d * w + b - base)
            words.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
        if batch.tree_words is None:
            batch.tree_words = [-1] * len(batch.input_ids)
        batch.tree_words[-w:] = words

    def _run(self, batch: FlatBatch, positions: list[int], state: torch.Tensor, from_target: bool) -> torch.Tensor:
        """One head pass over `batch` (laid out in the draft pool) at RoPE `positions`."""
        return self.head(torch.tensor(batch.input_ids), state, torch.tensor(positions), batch.metadata(_CPU),
                         from_target)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        """A draft-vocabulary row -> (target token, q over the target vocabulary, None for greedy rows)."""
        p = seq.request.params
        if p.greedy:
            return int(self.target_ids[logits.argmax()]), None
        q_draft = (logits / p.temperature).softmax(dim=-1)
        d = torch.multinomial(q_draft, 1, generator=seq.generator)[0]
        q = torch.zeros(self.vocab_size)
        q[self.target_ids] = q_draft
        return int(self.target_ids[d]), q

    def calibrate(self, reps: int = 5) -> tuple[float, float]:
        """Seconds of one chain pass over 1 and over 8 rows (best of `reps`), in blocks all free at start-up."""
        h = self.head.hidden_size
        dtype = self.head.norm.weight.dtype
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
