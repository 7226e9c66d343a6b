"""Megatron-style tensor parallelism: which part of every weight a rank holds, and the collectives between them.

A rank's model is the full architecture at its shard's sizes (`Shard.local_args`): its share of the attention
heads (whole KV groups, or one replicated KV head where the ranks outnumber them), of the MLP's intermediate
columns and of the vocabulary. `shard_weights` cuts the HF-named weight stream to those parts as it loads,
after quantization, so every rank holds exactly the weights (and groups) a single process would:
q/k/v, gate/up and the vocabulary split by output rows (column-parallel), o_proj and down_proj by input
columns (row-parallel, on whole quantization groups). `parallelize` then wraps the modules whose outputs are
partial sums or slices: o_proj and the MLP (one all-reduce each per layer), the embedding (masked lookup,
all-reduce) and the LM head (all-gather of the vocabulary slices). Everything else, norms, RoPE, routing,
runs replicated on identical hidden states: the collectives give every rank the same bits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import gguf_blocks
from pagoda.kernels.quant_linear import PackedWeight
from pagoda.model.args import ModelArgs
from pagoda.model.weights import Weight, fused_target

if TYPE_CHECKING:
    from pagoda.distributed.communicator import Communicator

# Output rows of a vocabulary slice and input columns of an MLP slice come in these units: panels of 16 rows
# for the quantized kernels; 128 columns keep INT4 groups (32/64/128) whole where the size allows.
_VOCAB_UNIT = 16
_COLUMN_UNITS = (128, 64, 32, 16, 1)


def split(n: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of n units, as balanced as n allows (earlier ranks take the remainder)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _column_split(size: int, world: int, rank: int) -> range:
    unit = next(u for u in _COLUMN_UNITS if size % u == 0 and size // u >= world)
    part = split(size // unit, world, rank)
    return range(part.start * unit, part.stop * unit)


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds: head, column and vocabulary ranges of the full model."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    intermediate: range      # a dense MLP's columns
    expert_intermediate: range  # each expert's columns (MoE models; empty otherwise)
    shared_intermediate: range  # the shared experts' columns (GLM-4.5; empty otherwise)
    vocab: range
    vocab_parts: tuple[int, ...]  # every rank's vocabulary slice width (the LM head's gather)

    @classmethod
    def of(cls, a: ModelArgs, rank: int, world: int) -> Shard:
        """Raises ValueError when `world` ranks cannot split `a`'s heads."""
        hq, hkv = a.num_heads, a.num_kv_heads
        group = hq // hkv
        if world <= hkv:  # whole KV groups per rank (uneven where the count does not divide)
            kv = split(hkv, world, rank)
            q = range(kv.start * group, kv.stop * group)
        else:  # each KV head replicated on world / hkv ranks, which split its group's query heads
            if world % hkv or hq % world:
                raise ValueError(f"tensor_parallel_size {world} cannot split {hq} attention heads over {hkv} KV "
                                 f"heads: use a size up to {hkv}, or a multiple of {hkv} that divides {hq}")
            per_kv = world // hkv
            kv = range(rank // per_kv, rank // per_kv + 1)
            q = range(rank * (hq // world), (rank + 1) * (hq // world))
        vocab_units = -(-a.vocab_size // _VOCAB_UNIT)
        if vocab_units < world:
            raise ValueError(f"tensor_parallel_size {world} exceeds the vocabulary's {vocab_units} slices")
        vocab_ranges = [split(vocab_units, world, r) for r in range(world)]
        vocab_parts = [range(p.start * _VOCAB_UNIT, min(p.stop * _VOCAB_UNIT, a.vocab_size)) for p in vocab_ranges]
        moe_cols = range(0) if a.moe is None else _column_split(a.moe.intermediate_size, world, rank)
        shared = a.moe.shared_intermediate if a.moe is not None else 0
        shared_cols = _column_split(shared, world, rank) if shared else range(0)
        return cls(rank, world, q, kv, _column_split(a.intermediate_size, world, rank), moe_cols, shared_cols,
                   vocab_parts[rank], tuple(len(p) for p in vocab_parts))

    def local_args(self, a: ModelArgs) -> ModelArgs:
        """`a` at this rank's sizes: the model class builds this rank's part from it."""
        moe = None if a.moe is None else dataclasses.replace(a.moe, intermediate_size=len(self.expert_intermediate),
                                                             shared_intermediate=len(self.shared_intermediate))
        return dataclasses.replace(a, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.intermediate), vocab_size=len(self.vocab), moe=moe)

    # ---- the weight stream -------------------------------------------------------------------------
    def _cut(self, a: ModelArgs, path: str, part: int) -> tuple[range | None, range | None]:
        """(output rows, input columns) of one unfused part of the module at `path` that this rank holds;
        None where that axis is not split."""
        module = path.rpartition(".")[2]
        mlp_cols = (self.expert_intermediate if ".experts." in f".{path}." else
                    self.shared_intermediate if ".shared_experts." in f".{path}." else self.intermediate)
        if module in ("gate_up_proj", "gate_proj", "up_proj"):
            return mlp_cols, None
        if module == "down_proj":
            return None, mlp_cols
        heads = self.q_heads if part == 0 or module == "o_proj" else self.kv_heads
        head_cols = range(heads.start * a.head_dim, heads.stop * a.head_dim)
        if module in ("qkv_proj", "q_proj", "k_proj", "v_proj"):
            return head_cols, None
        if module == "o_proj":
            return None, head_cols
        if module in ("embed_tokens", "lm_head"):
            return self.vocab, None
        return None, None

    def shard_weights(self, model: nn.Module, a: ModelArgs,
                      weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """Cut each HF-named weight of the full model `a` to this rank's part (`model`: this rank's model,
        which names the module each weight loads into). Weights stored fused (Phi-3's qkv_proj and
        gate_up_proj) are cut part by part."""
        for name, w in weights:
            hf_module, _, leaf = name.rpartition(".")
            path, index, _ = fused_target(model, hf_module)
            stored = hf_module.rpartition(".")[2]
            if stored in ("qkv_proj", "gate_up_proj"):  # [part 0; part 1; ...] as stored
                n = w.shape[0] if isinstance(w, torch.Tensor) else w.out_features
                q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
                widths = [q, kv, kv] if stored == "qkv_proj" else [n // 2, n // 2]
                starts = [sum(widths[:i]) for i in range(len(widths))]
                idx = [s + r for i, s in enumerate(starts) for r in self._cut(a, path, i)[0]]
                yield name, _take_rows(w, idx)
                continue
            rows, cols = self._cut(a, path, index)
            if rows is not None:
                yield name, _take_rows(w, list(rows))
            elif cols is not None and leaf == "bias":  # a row-parallel bias is added once, by rank 0
                yield name, w if self.rank == 0 else torch.zeros_like(w)
            elif cols is not None:
                yield name, _take_columns(w, cols, name)
            else:
                yield name, w


def _take_rows(w: Weight, rows: list[int]) -> Weight:
    index = torch.tensor(rows, dtype=torch.long)
    if isinstance(w, PackedWeight):
        return w.rows(index)
    return w[index].contiguous()


def _take_columns(w: Weight, cols: range, name: str) -> Weight:
    if isinstance(w, torch.Tensor):
        return w[:, cols.start:cols.stop].contiguous()
    if w.format == "gguf":  # whole super-blocks of every row
        if w.layout != "rows":
            raise ValueError(f"tensor parallelism: {name} is split before its GGUF blocks are put in panels")
        try:
            data, table = gguf_blocks.take_columns(w.data, w.scales, cols, w.in_features)
        except ValueError as e:
            raise ValueError(f"tensor parallelism: {name}: {e}; choose another tensor_parallel_size") from e
        return PackedWeight("gguf", data, table, None, w.group_size, len(cols))
    g = w.group_size
    per_channel = g == w.in_features  # one scale per row (int8, fp8): it covers any slice of the row
    if per_channel:
        g = len(cols)
    elif cols.start % g or len(cols) % g or w.layout != "rows":
        raise ValueError(f"tensor parallelism: {name} splits at input column {cols.start} (+{len(cols)}), not on its "
                         f"quantization groups of {g}; choose another tensor_parallel_size or group size")
    per_col = 0.5 if w.format == "int4" else 1  # bytes of `data` per input column
    data = w.data[:, int(cols.start * per_col):int(cols.stop * per_col)].contiguous()
    groups = slice(0, 1) if per_channel else slice(cols.start // g, cols.stop // g)
    return PackedWeight(w.format, data, w.scales[:, groups].contiguous(),
                        None if w.offsets is None else w.offsets[:, groups].contiguous(), g, len(cols))


# ---- the modules that communicate --------------------------------------------------------------------
class AllReduced(nn.Module):
    """A module whose output is this rank's partial sum (o_proj, an MLP ending in a row-parallel down_proj):
    summed over the ranks in place."""

    def __init__(self, inner: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.comm.all_reduce(out)
        return out

    __call__ = forward  # no hooks: skip nn.Module.__call__ (called twice a layer)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table: ids outside them give zeros, and the sum over ranks is the lookup."""

    def __init__(self, inner: nn.Module, vocab: range, comm: Communicator) -> None:
        super().__init__()
        self.inner, self.vocab, self.comm = inner, vocab, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.vocab.start) & (ids < self.vocab.stop)
        x = self.inner(torch.where(mine, ids - self.vocab.start, 0))
        x.masked_fill_(~mine.unsqueeze(-1), 0)
        self.comm.all_reduce(x)
        return x


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows; the ranks' slices are gathered into the full logits."""

    def __init__(self, inner: nn.Module, parts: tuple[int, ...], comm: Communicator) -> None:
        super().__init__()
        self.inner, self.parts, self.comm = inner, parts, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x)
        width = max(self.parts)
        if local.shape[-1] < width:  # all_gather takes equal shapes: pad, and drop the padding below
            local = F.pad(local, (0, width - local.shape[-1]))
        gathered = self.comm.all_gather(local.contiguous())  # [world, T, width]
        return torch.cat([gathered[r, :, :n] for r, n in enumerate(self.parts)], dim=-1)


def parallelize(model: nn.Module, shard: Shard, comm: Communicator) -> None:
    """Wrap `model`'s communicating modules, after prepare() chose their kernels. The C++ decoder stack runs
    every layer in one call with no collective between them: tensor-parallel ranks run the layers one by one."""
    for layer in model.layers:
        layer.self_attn.o_proj = AllReduced(layer.self_attn.o_proj, comm)
        layer.mlp = AllReduced(layer.mlp, comm)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard.vocab, comm)
    model.lm_head = VocabParallelHead(model.lm_head, shard.vocab_parts, comm)
    model.stack = None
