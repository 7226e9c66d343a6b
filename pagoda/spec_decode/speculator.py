"""Speculator: the proposer and verifier beside the model runner (it takes the runner, the KV manager and
the tokenizer, not the engine). The engine calls it twice a step:

verify()   after the forward: rejection-sample each sequence's positions into the tokens it emits (a ragged
           Emitted: the accepted proposals and the target's own). The engine appends them through the stop
           rules, and Scheduler.update rolls back what was rejected.
propose()  at the end of the step (vLLM v1's drafting after sampling): learn from the step (acceptance, the
           forward's cost; a draft model rolls back, an EAGLE or MTP head keeps the step's target states,
           head_proposer.py), then choose k per decoding sequence and draft the next step's proposals: n-gram
           lookups, or k passes of a draft model, the target's first layers, an EAGLE head or an MTP layer. The
           engine hands them to Scheduler.update_draft_token_ids; the scheduler counts them in its token budget,
           may trim them, and allocates their slots for the verification.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagoda.config import SpeculativeConfig
from pagoda.core import draft_tree
from pagoda.core.draft_tree import TokenTree
from pagoda.core.emitted import Emitted
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Sequence
from pagoda.core.scheduler import SchedulerOutput
from pagoda.executor.model_runner import ModelRunner
from pagoda.layers.sampler import SamplerOutput, SamplingBatch, sampler_output
from pagoda.model.loader import ModelFiles
from pagoda.model.tokenizer import Tokenizer
from pagoda.spec_decode import rejection
from pagoda.spec_decode.adaptive import AdaptivePolicy, StepCostModel
from pagoda.spec_decode.draft import ModelDraftProposer
from pagoda.spec_decode.head_proposer import DraftHead, HeadProposer
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.structured.backend import Matcher
from pagoda.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    """Running totals (vLLM's spec_decode_* counters)."""
    num_drafts: int = 0            # verifications of a request with at least one proposal
    num_draft_tokens: int = 0      # proposals verified
    num_accepted_tokens: int = 0   # proposals accepted
    num_emitted_tokens: int = 0    # tokens those verifications appended (accepted + the target's own, after stops)
    # accepted_per_pos[j]: verifications whose proposal j (0-based) was accepted (vLLM's _per_pos counter).
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 (the target's own) + accepted proposals."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def _calibrate(runner: ModelRunner, num_blocks: int, num_layers: int | None,
               shapes: tuple[tuple[int, int], tuple[int, int]], reps: int = 5) -> tuple[float, float]:
    """Seconds for one forward of each (rows, tokens per row) shape, the best of `reps` interleaved runs (other
    load on the machine only ever adds time). Writes scratch KV into blocks that are all free at start-up."""
    bs = runner.block_size
    batches = []
    for rows, tokens in shapes:
        per_row = -(-tokens // bs)
        batches.append([([0] * tokens, 0, [(r * per_row + j) % num_blocks for j in range(per_row)])
                        for r in range(rows)])
    best = [float("inf")] * len(batches)
    for rep in range(reps + 1):
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            runner.forward_rows(batch, num_layers)
            if rep:  # the first round warms up
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


@dataclass
class Verified:
    """What verification decided, for the engine to apply: per sequence, the tokens it emits."""
    seqs: list[Sequence]
    emitted: list[list[int]]       # the accepted proposals, then the target's own token
    first_row: list[int]           # each sequence's first position among the verified rows
    num_proposed: list[int]        # proposals verified (after the grammar cut them)
    logprobs: torch.Tensor | None  # log-softmax of every verified row, where a request asks for logprobs
    max_logprobs: int
    dead: list[Sequence]           # grammar allows no token at all: they emit nothing (the engine fails them)
    # Per sequence, the accepted proposals (indices into its proposals, in depth order): a chain's are 0, 1, ...;
    # a draft tree's are the branch verification took, whose KV the engine moves to their positions.
    paths: list[list[int]] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # how deep each one's proposals went (a chain: their number)

    def as_emitted(self) -> Emitted:
        """The live sequences' tokens as the step's ragged output."""
        live = [i for i, seq in enumerate(self.seqs) if seq not in self.dead]
        rows = [self.first_row[i] for i in live]

        def row_of(i: int, j: int) -> int:  # the verified row whose logits gave emitted token j
            return rows[i] + (0 if j == 0 else self.paths[live[i]][j - 1] + 1)

        def output_at(idx: list[int], j: int) -> SamplerOutput:
            tokens = torch.tensor([self.emitted[live[i]][j] for i in idx])
            lp = None if self.logprobs is None else self.logprobs[torch.tensor([row_of(i, j) for i in idx])]
            return sampler_output(tokens, lp, self.max_logprobs)
        return Emitted([self.seqs[i] for i in live], [self.emitted[i] for i in live], output_at)


@dataclass
class StepResult:
    """What a step did, after Scheduler.update, for the speculator to learn from."""
    sched: SchedulerOutput
    rejected: Mapping[int, int]     # per verified row: tokens scheduled and not appended (rolled back)
    verified: Verified | None
    appended: dict[Sequence, int]   # tokens appended per sequence, after stops
    aux_hidden: torch.Tensor | None  # the target's states an EAGLE head drafts from
    forward_s: float                # seconds of the step's forward
    step_s: float                   # seconds of the step before drafting
    tree_paths: dict[Sequence, list[int]] = field(default_factory=dict)  # draft trees' accepted proposals


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, target: ModelRunner, kv: KVCacheManager, tokenizer: Tokenizer,
                 max_model_len: int, token_budget: int, target_files: ModelFiles | None = None) -> None:
        """`target_files`: the target's checkpoint, where its MTP layer drafts (method "mtp")."""
        self.cfg = cfg
        self.target = target
        self.max_model_len = max_model_len
        self.token_budget = token_budget  # the scheduler's tokens per step
        self.stats = SpecDecodeStats()
        self.ngram: NgramProposer | None = None
        self.drafter: ModelDraftProposer | HeadProposer | None = None
        self._draft_probs: dict[int, torch.Tensor] = {}
        self.tree = TokenTree.parse(cfg.speculative_token_tree) if cfg.speculative_token_tree is not None else None
        n_blocks = kv.pool.num_blocks
        if cfg.method == "ngram":
            self.ngram = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        elif cfg.method == "self":
            if cfg.num_draft_layers is None or cfg.num_draft_layers >= target.args.num_layers:
                raise ValueError(f"speculative_config.num_draft_layers must be below the model's "
                                 f"{target.args.num_layers} layers")
            self.drafter = ModelDraftProposer(target, kv, None, cfg.num_draft_layers)
        elif cfg.method in ("eagle3", "mtp"):
            self.drafter = _load_head(cfg, target, kv, target_files)
            vocab = self.drafter.head.draft_vocab_size
            if self.tree is not None and max(max(p) for p in self.tree.paths) >= vocab:
                raise ValueError(f"speculative_config.speculative_token_tree: a rank past the head's draft "
                                 f"vocabulary of {vocab} tokens")
        else:
            self.drafter = _load_draft_model(cfg, target, kv, tokenizer)
        cost = StepCostModel(0.0, 0.0)
        if cfg.adaptive:
            t1, t_many = _calibrate(target, n_blocks, None, ((1, 1), (1, 32)))
            cost.add_point(1, t1, weight=5.0)
            cost.add_point(32, t_many, weight=5.0)
            if isinstance(self.drafter, HeadProposer):
                d1, d8 = self.drafter.calibrate()
            elif self.drafter is not None:
                d_runner, d_blocks = self.drafter.runner, (self.drafter.draft_kv or kv).pool.num_blocks
                d1, d8 = _calibrate(d_runner, d_blocks, self.drafter.num_layers, ((1, 1), (8, 1)))
            if self.drafter is not None:
                cost.d1 = max((d8 - d1) / 7, 1e-7)
                cost.d0 = max(d1 - cost.d1, 1e-6)
            logger.info("speculation cost model: forward %.2f ms + %.3f ms/token, draft pass %.2f ms + %.3f ms/row",
                        1e3 * cost.c0, 1e3 * cost.c1, 1e3 * cost.d0, 1e3 * cost.d1)
        self.policy = AdaptivePolicy(cost)

    # ---- after the forward -----------------------------------------------------------------------
    def verify(self, seqs: list[Sequence], logits: list[torch.Tensor],
               structured: StructuredOutputManager) -> Verified:
        """Accept/reject each sequence's scheduled proposals into the tokens it emits. Constrained rows are
        verified against the target masked by their grammar at every position, so what they emit is what
        decoding without speculation could."""
        params, gens, outs, prompts, banned = [], [], [], [], []
        rows: list[rejection.SpecRow] = []
        for seq, lg in zip(seqs, logits):
            draft, tree = seq.spec_token_ids, seq.spec_parents
            assert lg.shape[0] == len(draft) + 1
            q = self._draft_probs.get(seq.seq_id)
            rows.append(rejection.SpecRow(draft, None if q is None else q[:len(draft)], len(params), tree))
            p, req = seq.request.params, seq.request
            history = seq.output_token_ids
            for i in range(len(draft) + 1):  # position i: the root, then after proposal i - 1
                before = [draft[j] for j in draft_tree.path_to(tree, i - 1)] if tree else draft[:i]
                params.append(p)
                gens.append(seq.generator)
                outs.append(history + before)
                prompts.append(req.prompt_token_ids)
                banned.append(sorted(req.stop_ids) if seq.num_output_tokens + len(before) < p.min_tokens else [])
        batch = SamplingBatch(params=params, generators=gens, output_token_ids=[], prompt_token_ids=[],
                              banned_token_ids=banned)
        if batch.any_penalty:
            batch.output_token_ids, batch.prompt_token_ids = outs, prompts
        flat = torch.cat(logits).float()
        dead = _mask_to_grammar(flat, seqs, rows, structured)
        raw_logprobs = flat.log_softmax(dim=-1) if batch.max_logprobs >= 0 else None
        emitted, paths = rejection.verify(flat, batch, rows)
        depths = [max(draft_tree.depths(r.parents)) if r.parents else len(r.draft) for r in rows]
        return Verified(seqs, emitted, [r.params_batch_index for r in rows], [len(r.draft) for r in rows],
                        raw_logprobs, batch.max_logprobs, dead, paths, depths)

    # ---- at the end of the step -----------------------------------------------------------------
    def propose(self, step: StepResult, running: list[Sequence], queued_tokens: int,
                ) -> tuple[dict[Sequence, list[int]], dict[Sequence, list[int]]]:
        """Learn from `step`, then draft the next step's proposals for the decoding sequences of `running`
        (`queued_tokens`: prompt tokens still to compute, which share the next steps). Returns each sequence's
        proposals, cut to what its grammar allows, and the parents of those that form a draft tree."""
        if isinstance(self.drafter, HeadProposer):
            self.drafter.record(step.sched, step.rejected, step.aux_hidden, step.tree_paths)
        if step.verified is not None:
            self._count(step.verified, step.appended)
        if self.cfg.adaptive:
            self.policy.cost.observe(step.sched.total_tokens, step.forward_s, step.step_s)
        self._draft_probs.clear()
        live = {s.seq_id for s in running}
        self.policy.forget_except(live)
        if self.drafter is not None:
            self.drafter.release_except(live)
        tree = self.tree
        K = tree.depth if tree is not None else self.cfg.num_speculative_tokens
        cands: list[Sequence] = []
        max_ks: list[int] = []
        trees: list[TokenTree | None] = []
        for seq in running:
            if seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # still prefilling
            # Emitting k + 1 tokens must stay within max_tokens, and the k KV positions within the context.
            room = self.max_model_len - seq.num_tokens
            k = min(K, seq.request.max_tokens - seq.num_output_tokens - 1, room)
            if k > 0:
                cands.append(seq)
                max_ks.append(k)
                # Trees where the tree's nodes fit the context and no grammar cuts the proposals.
                trees.append(tree if tree is not None and seq.matcher is None and len(tree.paths) <= room else None)
        if not cands:
            return {}, {}
        other = min(queued_tokens, max(0, self.token_budget - len(running)))
        ids = [s.seq_id for s in cands]
        if self.ngram is not None:
            proposals = self.ngram.propose([s.token_ids for s in cands], max_ks)
            ks = [len(p) for p in proposals]
            if self.cfg.adaptive:
                ks = self.policy.choose(ids, ks, other)
            return {seq: d for seq, p, k in zip(cands, proposals, ks) if (d := _grammar_prefix(seq, p[:k]))}, {}
        sizes = [t.level_sizes() if t is not None else [1] * k for t, k in zip(trees, max_ks)]
        ks = self.policy.choose(ids, max_ks, other, sizes) if self.cfg.adaptive else max_ks
        rows = [(seq, k, t) for seq, k, t in zip(cands, ks, trees) if k > 0]
        if not rows:
            return {}, {}
        assert self.drafter is not None
        tree_parents: list[list[int]] = [[] for _ in rows]
        seqs, row_ks = [r[0] for r in rows], [r[1] for r in rows]
        if isinstance(self.drafter, HeadProposer):
            tokens, probs, tree_parents = self.drafter.propose(seqs, row_ks, [r[2] for r in rows])
        else:
            tokens, probs = self.drafter.propose(seqs, row_ks)
        drafts, parents = {}, {}
        for (seq, _, _), d, q, tp in zip(rows, tokens, probs, tree_parents):
            if q is not None:
                self._draft_probs[seq.seq_id] = q
            if tp:
                drafts[seq], parents[seq] = d, tp
            elif d := _grammar_prefix(seq, d):
                drafts[seq] = d
        return drafts, parents

    def _count(self, verified: Verified, appended: dict[Sequence, int]) -> None:
        """Acceptance into the stats and the adaptive policy; a draft model rolls back what was rejected."""
        st = self.stats
        st.num_emitted_tokens += sum(appended.get(s, 0) for s in verified.seqs)
        for seq, e, k, depth in zip(verified.seqs, verified.emitted, verified.num_proposed, verified.depths):
            accepted = len(e) - 1
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += accepted
            if len(st.accepted_per_pos) < accepted:
                st.accepted_per_pos += [0] * (accepted - len(st.accepted_per_pos))
            for j in range(accepted):
                st.accepted_per_pos[j] += 1
            self.policy.update(seq.seq_id, depth, accepted)
            if isinstance(self.drafter, ModelDraftProposer):
                self.drafter.rollback(seq)


def _load_draft_model(cfg: SpeculativeConfig, target: ModelRunner, kv: KVCacheManager,
                      tokenizer: Tokenizer) -> ModelDraftProposer:
    from pagoda.model.args import ModelArgs
    from pagoda.model.loader import resolve_model_files
    from pagoda.model.tokenizer import load_tokenizer

    files = resolve_model_files(cfg.model)
    args = ModelArgs.from_hf_config(files.hf_config)
    if args.vocab_size != target.args.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({args.vocab_size}) differs from "
                         f"the target's ({target.args.vocab_size})")
    try:
        draft_tok = load_tokenizer(files)
    except Exception:  # noqa: BLE001 - a draft without tokenizer files borrows the target's
        draft_tok = None
    probe = "Speculative decoding: the quick brown fox, 12345!"
    if draft_tok is not None and draft_tok.encode(probe) != tokenizer.encode(probe):
        raise ValueError("speculative_config.model: the draft's tokenizer differs from the target's")
    runner = ModelRunner(target.config, files, args, target.dtype, target.policy)
    num_blocks = kv.pool.num_blocks  # as many blocks as the target: every running sequence fits
    runner.allocate_kv_cache(num_blocks)
    draft_kv = KVCacheManager(num_blocks, target.config.cache.block_size, enable_prefix_caching=False)
    return ModelDraftProposer(runner, kv, draft_kv, None)


def _load_head(cfg: SpeculativeConfig, target: ModelRunner, kv: KVCacheManager,
               target_files: ModelFiles | None) -> HeadProposer:
    """An EAGLE-3 head from its folder, or the target checkpoint's MTP layer, drafting over the target's states."""
    from pagoda.model.llama import LlamaForCausalLM

    if not isinstance(target, ModelRunner):
        raise ValueError(f"speculative_config: method {cfg.method!r} runs with tensor_parallel_size 1")
    model = target.model
    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        raise ValueError(f"speculative_config: method {cfg.method!r} drafts for Llama-family targets, not "
                         f"{target.args.architecture}")
    head: DraftHead
    if cfg.method == "mtp":
        from pagoda.spec_decode.mtp import load_mtp_head

        assert target_files is not None
        head = load_mtp_head(target_files, model, target.dtype, target.policy,
                             target.config.scheduler.max_model_len, cfg.quantization)
        model.aux_output = True
    else:
        from pagoda.spec_decode.eagle3_head import load_head

        assert cfg.model is not None
        eagle = load_head(cfg.model, target.args, model.embed_tokens, target.dtype, target.policy, cfg.quantization)
        model.aux_layers = eagle.config.aux_layers
        head = eagle
    return HeadProposer(head, kv.pool.num_blocks, kv.block_size, target.args.vocab_size)


def _grammar_prefix(seq: Sequence, proposal: list[int]) -> list[int]:
    """The proposals a constrained sequence's grammar allows, up to the first it forbids: verifying a token
    the grammar forbids could only end in its rejection."""
    if seq.matcher is None:
        return proposal
    probe = seq.matcher.fork()
    for i, token in enumerate(proposal):
        if probe.is_terminated() or not probe.accept(token):
            return proposal[:i]
    return proposal


def _mask_to_grammar(flat: torch.Tensor, seqs: list[Sequence], rows: list[rejection.SpecRow],
                     structured: StructuredOutputManager) -> list[Sequence]:
    """Mask, in place, each constrained row's logits at every position by its grammar there (after the
    proposals before it), in one batched call: the target distribution is the constrained one, so what
    rejection sampling emits is what decoding without speculation could. A position whose grammar allows
    nothing shortens the proposals so that it is never reached; at the first position, the sequence is
    returned as dead."""
    where: dict[int, tuple[int, int]] = {}  # masked row -> (sequence, position)
    matchers: list[Matcher] = []
    for s, (seq, row) in enumerate(zip(seqs, rows)):
        if seq.matcher is None:
            continue
        probe = seq.matcher.fork()
        for i in range(len(row.draft) + 1):
            where[row.params_batch_index + i] = (s, i)
            matchers.append(probe.fork() if i < len(row.draft) else probe)
            if i < len(row.draft) and not probe.accept(row.draft[i]):  # propose() cut what it forbids
                raise RuntimeError(f"proposal {row.draft[i]} is one its grammar forbids")
    if not where:
        return []
    dead: list[Sequence] = []
    for r in structured.mask_logits(flat, list(where), matchers):
        s, i = where[r]
        flat[r] = 0.0  # keeps the sampler's arithmetic finite; nothing is taken from this row
        if i == 0:
            dead.append(seqs[s])
        elif len(rows[s].draft) >= i:
            rows[s].draft = rows[s].draft[:i - 1]
    return dead
