"""ModelRunner: a scheduled batch -> flat varlen tensors -> one forward pass -> logits of sampling rows."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagoda.config import EngineConfig
from pagoda.core.scheduler import SchedulerOutput
from pagoda.layers.attention import AttentionMetadata
from pagoda.model.args import ModelArgs
from pagoda.model.loader import ModelFiles
from pagoda.model.registry import model_class

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    sample_logits: torch.Tensor           # fp32 [num_sampling_seqs, V]
    sample_rows: list[int]                # index into SchedulerOutput.seqs for each logits row
    # Per scheduled index: fp32 [chunk_len, V] logits over prompt positions, when prompt logprobs are due.
    prompt_logits: dict[int, torch.Tensor]


class ModelRunner:
    def __init__(self, config: EngineConfig, files: ModelFiles, args: ModelArgs, dtype: torch.dtype) -> None:
        self.config = config
        self.args = args
        self.dtype = dtype
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = model_class(args)(args)
        model = model.to_empty(device=self.device).to(dtype)
        # Non-persistent buffers (rope tables) were never materialized on meta: rebuild them.
        for m in model.modules():
            if hasattr(m, "cos") and hasattr(m, "sin"):
                fresh = type(m)(args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling)
                m.cos, m.sin = fresh.cos.to(self.device), fresh.sin.to(self.device)
        model.load_weights(files.iter_weights(dtype))
        if args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.prepare()
        self.model = model.eval()
        logger.info("loaded %s in %.1fs", args.architecture, time.perf_counter() - t0)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- KV pool -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        a = self.args
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_layers * a.num_kv_heads * self.block_size * a.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One preallocated pool per layer: [num_blocks, Hkv, block_size, D] for K and for V."""
        a = self.args
        shape = (num_blocks, a.num_kv_heads, self.block_size, a.head_dim)
        self.kv_caches = []
        for attn in self.model.attention_layers():
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[int, list[int]]) -> ModelOutput:
        self.copy_blocks(sched.block_copies)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_idx: list[int] = []
        sample_rows: list[int] = []
        prompt_spans: dict[int, tuple[int, int]] = {}
        tables = []
        for row, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled)):
            start = seq.num_computed_tokens
            end = start + n
            table = block_tables[seq.seq_id]
            tables.append(table)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            span = seq.request.prompt_logprobs_span(start, end)
            if span is not None:  # (first, last) prompt positions -> (flat offset, length)
                prompt_spans[row] = (query_start[-1] + span[0] - start, span[1] - span[0])
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the chunk reaches the last token: it samples
                sample_idx.append(query_start[-1] - 1)
                sample_rows.append(row)
        width = max(len(t) for t in tables)
        table_tensor = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table_tensor[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=table_tensor.to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        )
        hidden = self.model(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta)
        if len(sample_idx) == len(input_ids):  # pure decode: every token samples, no gather needed
            logits = self.model.compute_logits(hidden)
        elif sample_idx:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=dev)])
        else:
            logits = torch.empty(0, self.args.vocab_size)
        prompt_logits = {row: self.model.compute_logits(hidden[s:s + length])
                         for row, (s, length) in prompt_spans.items() if length > 0}
        return ModelOutput(sample_logits=logits.cpu(), sample_rows=sample_rows,
                           prompt_logits={r: t.cpu() for r, t in prompt_logits.items()})
