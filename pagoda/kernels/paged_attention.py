"""Paged attention over a block-structured KV cache (CPU).

`paged_attention` runs a C++ kernel (compiled lazily on first use, cached on disk
across processes) and falls back to `paged_attention_reference`, a simple pure-torch
version, when the kernel cannot be built or config says `kernels="torch"`.

Cache layout: ``[num_blocks, Hkv, block_size, D]``; a token at position ``j`` of
sequence ``b`` lives at ``cache[block_tables[b, j // block_size], :, j % block_size]``.
An 8-bit cache (kv_cache_dtype int8/fp8) comes with fp32 scales ``[num_blocks, Hkv, block_size]``
and is dequantized row by row inside the kernel (pagoda/kernels/kv_quant.py).

A bf16 K cache is stored as words where the kernel multiplies it with bf16 dot products
(`k_cache_shape`): ``[num_blocks, Hkv, D/2, block_size, 2]``, each 32-bit word a pair of d of one key,
consecutive keys' words adjacent. One 64-byte load then holds a pair of d for 16 keys, which is the
operand of vdpbf16ps, so scores need no horizontal sums and K no staging (faster decode attention, hot
and cold: `python -m benchmarks.attention`, figures in docs/benchmarks.md). V stays
row-major: P @ V reads V by rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagoda.kernels.cpu_extension import build_isa, kernel_available

logger = logging.getLogger(__name__)
_warned = False


@dataclass(slots=True)
class AttentionMetadata:
    """Flat (varlen) description of one step's batch, shared by every layer."""

    slot_mapping: torch.Tensor     # int64 [T]: cache slot of each new token
    block_tables: torch.Tensor     # int32 [B, max_blocks]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor         # int32 [B]: context length including this step's tokens
    # int64 [T], or None: draft trees (speculative decoding). Bit j of a query's word covers key
    # seq_len - TREE_SPAN + j of its sequence; a clear bit hides that key. -1: causal only.
    tree_mask: torch.Tensor | None = None


TREE_SPAN = 64  # the keys at a sequence's end a tree mask covers (kernels/cpu/paged_attention.cpp: kTreeSpan)


def k_words_supported(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether a K cache of this dtype and shape is stored as words: bf16, where the loaded build's kernel
    takes them (AVX512-BF16)."""
    return dtype == torch.bfloat16 and block_size % 16 == 0 and head_dim % 32 == 0 and build_isa().avx512_bf16


def k_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                  dtype: torch.dtype, kernel: bool | None = None) -> tuple[int, ...]:
    """The K cache's shape: words (5-D) where `k_words_supported` and the kernels are used (`kernel`: the
    engine's KernelPolicy.cpp; None: whether they built), else like V's."""
    if (kernel is not False) and k_words_supported(dtype, block_size, head_dim):
        return (num_blocks, num_kv_heads, head_dim // 2, block_size, 2)
    return (num_blocks, num_kv_heads, block_size, head_dim)


def k_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """K blocks as rows, [n, Hkv, block_size, D] (a copy when they are stored as words)."""
    if k_cache.dim() == 4:
        return k_cache
    n, h, d2, bs, _ = k_cache.shape
    return k_cache.permute(0, 1, 3, 2, 4).reshape(n, h, bs, 2 * d2)


def k_words(k_rows: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, block_size, D] rows -> the words layout (contiguous)."""
    n, h, bs, d = k_rows.shape
    return k_rows.reshape(n, h, bs, d // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


def _kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, quantized: bool) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and (quantized or k_cache.dtype == q.dtype) and q.shape[-1] % 16 == 0 and k_cache.stride(-1) == 1)


def fused_attention_supported(qkv: torch.Tensor, k_cache: torch.Tensor | None, quantized: bool) -> bool:
    """Whether torch.ops.pagoda.rope_cache_attention takes this layer's tensors: what the rope,
    write_kv and paged_attention kernels each need (the C++ ops themselves are available: the
    caller checked kernel_available()). The model runner's metadata is int32 already."""
    return (k_cache is not None and qkv.dim() == 2 and qkv.stride(1) == 1 and k_cache.is_contiguous()
            and _kernel_supports(qkv, k_cache, quantized))


def _i32(t: torch.Tensor) -> torch.Tensor:
    # skip the no-op calls: this runs once per layer per step
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.is_contiguous() else t.contiguous()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of flat queries ``q [T, Hq, D]`` over the paged cache.

    Query ``i`` of sequence ``b`` sits at position ``p = seq_lens[b] - q_len_b + i`` and
    sees keys ``0..p``, or ``p - window + 1..p`` with a sliding ``window`` (> 0); block-table
    entries before the block of a sequence's first visible key are never read. ``softcap`` (> 0)
    caps each scaled score as ``softcap * tanh(s / softcap)`` (Gemma 2). ``tree_mask`` (int64 ``[T]``,
    see AttentionMetadata) hides, per query, keys among its sequence's last TREE_SPAN: a draft tree's node
    sees the context and its own ancestors only (they come before it in flat order: causality holds).
    Returns ``[T, Hq, D]`` in ``q``'s dtype.
    ``k_scale``/``v_scale`` are given exactly when the cache is 8-bit. The C++ kernel runs where it is built and
    takes these tensors; `paged_attention_reference` is its torch twin.
    """
    quantized = k_scale is not None
    use_kernel = kernel_available()
    if use_kernel and _kernel_supports(q, k_cache, quantized):
        return torch.ops.pagoda.paged_attention(
            q.contiguous(), k_cache, v_cache, _i32(block_tables), _i32(query_start_loc),
            _i32(seq_lens), float(scale), k_scale, v_scale, window, softcap, tree_mask)
    global _warned
    if use_kernel and not _warned:
        _warned = True
        logger.warning("paged_attention: C++ kernel not used for dtype=%s D=%d; using the torch reference",
                       q.dtype, q.shape[-1])
    return paged_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                     k_scale, v_scale, window, softcap, tree_mask)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch paged attention: per sequence, gather its blocks (from the first one a query's window
    reaches) and apply a causal mask, the window's and the tree's."""
    T, Hq, D = q.shape
    _, Hkv, bs, _ = v_cache.shape
    group = Hq // Hkv
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        first = max(0, seq_len - q_len - window + 1) // bs if window > 0 else 0  # earlier blocks may be freed
        k0, n = first * bs, seq_len - first * bs  # keys [k0, seq_len)
        blocks = block_tables[b, first: (seq_len + bs - 1) // bs].long()
        # [n, Hkv, bs, D] -> [Hkv, n*bs, D] -> the keys up to seq_len, one copy per query head.
        k = k_rows(k_cache[blocks]).transpose(0, 1).reshape(Hkv, -1, D)[:, :n].float()
        v = v_cache[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :n].float()
        if k_scale is not None and v_scale is not None:  # 8-bit cache: one scale per (head, token)
            k = k * k_scale[blocks].transpose(0, 1).reshape(Hkv, -1)[:, :n].unsqueeze(-1)
            v = v * v_scale[blocks].transpose(0, 1).reshape(Hkv, -1)[:, :n].unsqueeze(-1)
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        qb = q[q0:q1].transpose(0, 1).float()  # [Hq, q_len, D]
        scores = (qb @ k.transpose(1, 2)) * scale  # [Hq, q_len, n]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        key_pos = torch.arange(k0, seq_len).unsqueeze(0)
        allowed = key_pos <= pos
        if window > 0:
            allowed &= key_pos > pos - window
        if tree_mask is not None:
            bit = key_pos - (seq_len - TREE_SPAN)  # [1, n]
            words = tree_mask[q0:q1].unsqueeze(1)  # [q_len, 1]
            hidden = (bit >= 0) & (words != -1) & ((words >> bit.clamp(0, TREE_SPAN - 1)) & 1 == 0)
            allowed &= ~hidden
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out
