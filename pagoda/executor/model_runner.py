"""ModelRunner: a scheduled batch -> flat varlen tensors -> one forward pass -> logits of sampling rows."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagoda.config import EngineConfig
from pagoda.core import draft_tree
from pagoda.core.scheduler import SchedulerOutput
from pagoda.distributed.tensor_parallel import Shard, parallelize
from pagoda.kernels.fused_ops import move_kv_slots
from pagoda.kernels.kv_quant import SCALE_DTYPE, kv_cache_format
from pagoda.kernels.paged_attention import AttentionMetadata, k_cache_shape
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.lora.manager import LoRAManager
from pagoda.model.args import ModelArgs
from pagoda.model.loader import ModelFiles
from pagoda.model.registry import model_class
from pagoda.model.weights import is_linear_weight, load_weights
from pagoda.quantization.loading import load_plan

if TYPE_CHECKING:
    from pagoda.distributed.communicator import Communicator

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    sample_logits: torch.Tensor           # fp32 [num_sampling_seqs, V]
    sample_rows: list[int]                # index into SchedulerOutput.seqs for each logits row
    # Per scheduled index: fp32 [chunk_len, V] logits over prompt positions, when prompt logprobs are due.
    prompt_logits: dict[int, torch.Tensor]
    # Speculative verification: per scheduled index, fp32 [1 + k, V] logits at the last token and its k proposals.
    spec_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # EAGLE-3: the residual stream entering each captured layer, side by side, at every token of the step
    # [T, 3 * hidden] (the model's aux_layers; None when none are set).
    aux_hidden: torch.Tensor | None = None


@dataclass
class FlatBatch:
    """Rows of (tokens, first position, block table) flattened into one varlen batch."""
    block_size: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)     # cache slot of each token
    query_start: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)  # context length of each row after this step
    tables: list[list[int]] = field(default_factory=list)
    tree_words: list[int] | None = None  # each token's tree-mask word, once a row verifies a draft tree

    def add(self, tokens: list[int], start: int, table: list[int], positions: list[int] | None = None,
            tree_words: list[int] | None = None) -> None:
        """A row computing positions [start, start + len(tokens)) of its sequence (its KV slots). `positions`: the
        tokens' RoPE positions where they are not those (a draft tree's depths); `tree_words`: their tree-mask
        words (AttentionMetadata.tree_mask; core/draft_tree.py), None: causal."""
        bs, end = self.block_size, start + len(tokens)
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, end) if positions is None else positions)
        if tree_words is not None or self.tree_words is not None:
            if self.tree_words is None:
                self.tree_words = [-1] * (len(self.input_ids) - len(tokens))
            self.tree_words += [-1] * len(tokens) if tree_words is None else tree_words
        self.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        self.query_start.append(self.query_start[-1] + len(tokens))
        self.seq_lens.append(end)
        self.tables.append(table)

    def metadata(self, device: torch.device) -> AttentionMetadata:
        """The flat tensors every layer's attention reads; block tables padded to the widest row."""
        width = max(len(t) for t in self.tables)
        # One tensor from padded lists: a tensor per row costs more than the rows' copying.
        padded = [t if len(t) == width else t + [0] * (width - len(t)) for t in self.tables]
        return AttentionMetadata(
            slot_mapping=torch.tensor(self.slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(self.query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            tree_mask=None if self.tree_words is None else torch.tensor(self.tree_words, dtype=torch.int64,
                                                                        device=device),
        )


class ModelRunner:
    """One process's model and KV pool. Under tensor parallelism (`shard`, `comm`) each rank's runner holds its
    shard (distributed/tensor_parallel.py) and runs the same StepInputs as every other rank."""

    def __init__(self, config: EngineConfig, files: ModelFiles, args: ModelArgs, dtype: torch.dtype,
                 policy: KernelPolicy, shard: Shard | None = None, comm: Communicator | None = None) -> None:
        self.config = config
        self.policy = policy
        self.args = args  # the full model's (the logits' width)
        self.local_args = args if shard is None else shard.local_args(args)  # what this process holds
        self.dtype = dtype
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        # The longest context served (the engine checks it against the model's); LongRoPE picks its factors by it.
        max_model_len = config.scheduler.max_model_len or args.max_position_embeddings
        with torch.device("meta"):
            model = model_class(args)(self.local_args, max_model_len)
        model = model.to_empty(device=self.device).to(dtype)
        # Non-persistent buffers (rope tables) were never materialized on meta: rebuild them.
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                m.materialize(self.device)
        # Weights as stored, or quantized by config.quantization (ties lm_head to the embedding).
        plan = load_plan(files, dtype, config.quantization, config.quantization_group_size,
                         functools.partial(is_linear_weight, model))
        if shard is not None:
            plan = dataclasses.replace(plan, weights=shard.shard_weights(model, args, plan.weights))
        load_weights(model, plan, dtype)
        model.prepare(policy)
        if shard is not None:
            assert comm is not None
            parallelize(model, shard, comm)
        self.model = model.eval()
        # Adapter slots in the model's Linears, where LoRA is on (tensor parallelism is refused with it: config.py).
        self.lora = LoRAManager(model, config.lora, policy.cpp, dtype) if config.lora.enable_lora else None
        logger.info("loaded %s in %.1fs", args.architecture, time.perf_counter() - t0)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_scales: list[tuple[torch.Tensor, torch.Tensor]] = []  # 8-bit kv_cache_dtype only

    # ---- KV pool -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """K and V of every layer for one block, 8-bit formats' scales included (the pool size stays honest)."""
        a = self.local_args
        fmt = kv_cache_format(self.config.cache.kv_cache_dtype, self.dtype)
        return 2 * a.num_layers * a.num_kv_heads * self.block_size * fmt.bytes_per_row(a.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One preallocated pool per layer: [num_blocks, Hkv, block_size, D] for K and for V (a bf16 K as
        words on CPUs whose attention kernel takes them: kernels/paged_attention.py k_cache_shape).

        8-bit kv_cache_dtype adds fp32 scales [num_blocks, Hkv, block_size] per layer for K and V."""
        a = self.local_args
        fmt = kv_cache_format(self.config.cache.kv_cache_dtype, self.dtype)
        shape = (num_blocks, a.num_kv_heads, self.block_size, a.head_dim)
        k_shape = k_cache_shape(*shape, fmt.dtype, self.policy.cpp) if self.device.type == "cpu" else shape
        # torch.empty on CPU: a large fresh allocation is mmap'd zero pages that the OS maps in only when
        # written, so RSS follows the tokens cached rather than the pool size (zeros would touch every page).
        # Unwritten slots are never read: attention only reads a sequence's first seq_len keys (the NaN-filled
        # caches of tests/test_paged_attention.py and test_kv_cache_dtype.py pin this down).
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        self.kv_caches = []
        self.kv_scales = []
        for attn in self.model.attention_layers():
            k = alloc(k_shape, dtype=fmt.dtype, device=self.device)
            v = alloc(shape, dtype=fmt.dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))
            if fmt.quantized:
                ks = alloc(shape[:3], dtype=SCALE_DTYPE, device=self.device)
                vs = alloc(shape[:3], dtype=SCALE_DTYPE, device=self.device)
                attn.k_scale, attn.v_scale = ks, vs
                self.kv_scales.append((ks, vs))

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy the KV of single token slots (from, to), in every layer: a verified draft tree's accepted nodes to
        the slots of their positions (core/draft_tree.py)."""
        if moves:
            move_kv_slots([c for kv in self.kv_caches + self.kv_scales for c in kv], moves, self.block_size)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches + self.kv_scales:  # an 8-bit pool's scales travel with their blocks
            k[dst] = k[src]
            v[dst] = v[src]

    # ---- one step ------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput, block_tables: dict[int, list[int]]) -> ModelOutput:
        return self.run(step_input(sched, block_tables, self.block_size))

    @torch.inference_mode()
    def run(self, step: StepInput) -> ModelOutput:
        """One forward over `step`, and the logits it asks for (every rank of a tensor-parallel group runs it)."""
        self.copy_blocks(step.block_copies)
        batch = step.batch
        dev = self.device
        if self.lora is not None:
            self.lora.mapping.set(step.lora_slots, batch.query_start, dev)
        hidden = self.model(torch.tensor(batch.input_ids, device=dev), torch.tensor(batch.positions, device=dev),
                            batch.metadata(dev), num_layers=step.num_layers)
        sample_idx = step.sample_idx
        if len(sample_idx) == len(batch.input_ids):  # pure decode: every token samples, no gather needed
            logits = self.model.compute_logits(hidden)
        elif sample_idx:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=dev)])
        else:
            logits = torch.empty(0, self.args.vocab_size)
        prompt_logits = {row: self.model.compute_logits(hidden[s:s + length])
                         for row, (s, length) in step.prompt_spans.items() if length > 0}
        spec_logits: dict[int, torch.Tensor] = {}
        if step.spec_spans:
            spans = step.spec_spans
            spec = self.model.compute_logits(torch.cat([hidden[s:s + length] for s, length in spans.values()]))
            spec_logits = dict(zip(spans, spec.cpu().split([length for _, length in spans.values()])))
        captures = self.model.aux_layers or self.model.aux_output
        aux = self.model.aux_hidden if captures and step.num_layers is None else None
        return ModelOutput(sample_logits=logits.cpu(), sample_rows=step.sample_rows,
                           prompt_logits={r: t.cpu() for r, t in prompt_logits.items()}, spec_logits=spec_logits,
                           aux_hidden=aux)

    def forward_rows(self, rows: list[tuple[list[int], int, list[int]]], num_layers: int | None = None) -> torch.Tensor:
        """Run (tokens, first position, block table) rows, writing their KV; fp32 logits at each row's last token.

        The drafting path of speculative decoding: `num_layers` stops after the first L layers (early exit)."""
        return self.run(rows_input(rows, self.block_size, num_layers)).sample_logits

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """One whole sequence through the model in one forward, written into the pool's first blocks (scratch:
        for offline use, with nothing else running): the residual stream entering each of `layers`, side by
        side [T, len(layers) * hidden], and the final normed states [T, hidden] (model.compute_logits of them
        are the logits)."""
        n_blocks = -(-len(token_ids) // self.block_size)
        if n_blocks > self.kv_caches[0][0].shape[0]:
            raise ValueError(f"{len(token_ids)} tokens do not fit the KV pool")
        batch = FlatBatch(self.block_size)
        batch.add(token_ids, 0, list(range(n_blocks)))
        model, saved = self.model, self.model.aux_layers
        model.aux_layers = layers
        try:
            hidden = model(torch.tensor(token_ids, device=self.device),
                           torch.tensor(batch.positions, device=self.device), batch.metadata(self.device))
            aux = model.aux_hidden
        finally:
            model.aux_layers = saved
        assert aux is not None
        return aux, hidden


@dataclass
class StepInput:
    """Everything one forward needs, as plain data: what rank 0 sends the other ranks of a tensor-parallel group."""
    batch: FlatBatch
    sample_idx: list[int]                 # flat index of each token that samples
    sample_rows: list[int]                # its row in the SchedulerOutput
    prompt_spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (flat offset, length)
    spec_spans: dict[int, tuple[int, int]] = field(default_factory=dict)    # row -> (flat offset, 1 + k)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_layers: int | None = None         # early exit (self-speculative drafts)
    # Each row's LoRA slot (-1: the base model); empty: every row runs the base model (drafts do too).
    lora_slots: list[int] = field(default_factory=list)


def step_input(sched: SchedulerOutput, block_tables: dict[int, list[int]], block_size: int) -> StepInput:
    """The flat batch of a scheduled step, and which of its positions need logits."""
    batch = FlatBatch(block_size)
    step = StepInput(batch, [], [], block_copies=list(sched.block_copies))
    for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled)):
        start = seq.num_computed_tokens
        end = start + n
        offset = batch.query_start[-1]
        tokens = seq.token_ids[start:end]
        num_spec = end - seq.num_tokens  # > 0: verify the last token and this many proposals
        positions = words = None
        if num_spec > 0:
            tokens = tokens + seq.spec_token_ids[:num_spec]
            step.spec_spans[row] = (offset + seq.num_tokens - 1 - start, num_spec + 1)
            if seq.spec_parents:
                positions, words = draft_tree.verify_layout(seq.spec_parents[:num_spec], start, end)
        batch.add(tokens, start, block_tables[seq.seq_id], positions, words)
        span = seq.request.prompt_logprobs_span(start, end)
        if span is not None:  # (first, last) prompt positions -> (flat offset, length)
            step.prompt_spans[row] = (offset + span[0] - start, span[1] - span[0])
        if end == seq.num_tokens:  # the chunk reaches the last token: it samples
            step.sample_idx.append(offset + n - 1)
            step.sample_rows.append(row)
    slots = [seq.request.lora_slot for seq in sched.seqs]
    if any(s >= 0 for s in slots):
        step.lora_slots = slots
    return step


def rows_input(rows: list[tuple[list[int], int, list[int]]], block_size: int, num_layers: int | None) -> StepInput:
    """(tokens, first position, block table) rows sampling at their last token."""
    batch = FlatBatch(block_size)
    for tokens, start, table in rows:
        batch.add(tokens, start, table)
    last = [end - 1 for end in batch.query_start[1:]]
    return StepInput(batch, last, list(range(len(rows))), num_layers=num_layers)
