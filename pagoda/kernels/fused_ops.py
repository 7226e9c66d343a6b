"""Fused per-layer ops (RMSNorm with residual add, RoPE, SiLU-and-mul, KV write), the KV slot moves of draft
trees, and the sampler's argmax.

Each has a C++ CPU kernel (pagoda/kernels/cpu/fused_ops.cpp) and a torch twin with the same numerics (fp32 math,
HF's rounding points): `op` runs the kernel where it is built and takes the tensors (CPU fp32/bf16, the layout it
reads), else the twin; `op_torch` is the twin alone. A layer binds one of the two once, at its model's prepare(),
from its KernelPolicy (bind_ops).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.kernels.cpu_extension import kernel_available
from pagoda.kernels.kv_quant import quantize_kv

# With AVX-512 (in the loaded build: cpu_extension.build_isa) the C++ ops are vectorized and row-parallel,
# faster than torch's (RMSNorm with the residual add, silu_and_mul), and they round where HF's unfused ops do.
# Without it (the avx2 build) their scalar loops only win where op count dominates (decode, a few rows), but they
# run at every row count too: a row's result must not depend on how many rows share the step (batch invariance),
# and torch's ops round elsewhere.


def _use_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and kernel_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * normalize(x); with `residual`: residual += x in place, and the sum is normalized."""
    if x.dim() == 2 and _use_kernel(x):
        return torch.ops.pagoda.rms_norm(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    if x.device.type == "cpu":  # one fused op (fp32 math inside); rounds once, where HF rounds twice in bf16
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rotate (rotate-half layout) the q and k heads of fused qkv rows [T, (Hq+2Hkv)*D] in place. cos/sin are
    [max_pos, R/2]: the first R dims of each head rotate, the rest pass through (partial rotary; R = D mostly)."""
    if _use_kernel(qkv) and qkv.stride(1) == 1:
        torch.ops.pagoda.rope_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)
        return
    rope_torch_(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim)


def rope_torch_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    T = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(T, -1, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = cos.shape[1]
    x1, x2 = qk[..., :half].float(), qk[..., half: 2 * half].float()
    qk[..., : 2 * half] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up."""
    if x.stride(-1) == 1 and x.dim() == 2 and _use_kernel(x):
        return torch.ops.pagoda.silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Store token t's k[t], v[t] ([Hkv, D]) at cache slot slot_mapping[t] = block * block_size + offset.

    With scales ([num_blocks, Hkv, block_size] fp32) the cache is 8-bit (pagoda/kernels/kv_quant.py):
    each (token, head) row is quantized with its own scale on the way in.
    """
    quant = k_scale is not None
    if (_use_kernel(k) and (quant or k.dtype == k_cache.dtype) and k_cache.is_contiguous()
            and k.stride(-1) == 1 and v.stride(-1) == 1):
        if quant:
            torch.ops.pagoda.write_kv_(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        else:
            torch.ops.pagoda.write_kv_(k, v, k_cache, v_cache, slot_mapping)
        return
    write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def write_kv_cache_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    quant = k_scale is not None
    bs = v_cache.shape[2]
    slots = slot_mapping.long()
    blocks = torch.div(slots, bs, rounding_mode="floor")
    offsets = slots - blocks * bs
    # Two advanced indices around a slice: the indexed view is [T, Hkv, D], matching k.
    if quant:
        assert v_scale is not None
        kq, ks = quantize_kv(k, k_cache.dtype)
        vq, vs = quantize_kv(v, v_cache.dtype)
        k_cache[blocks, :, offsets] = kq
        v_cache[blocks, :, offsets] = vq
        k_scale[blocks, :, offsets] = ks
        v_scale[blocks, :, offsets] = vs
        return
    if k_cache.dim() == 5:  # K as words [N, Hkv, D/2, bs, 2] (paged_attention.k_cache_shape): [T, Hkv, D/2, 2]
        k_cache[blocks, :, :, offsets] = k.to(k_cache.dtype).unflatten(-1, (-1, 2))
    else:
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def move_kv_slots(caches: list[torch.Tensor], moves: list[tuple[int, int]], block_size: int) -> None:
    """Copy single token slots (from, to), in order, in each paged cache (K, V, an 8-bit pool's scales): a
    verified draft tree's accepted nodes to the slots of their positions. One call for every cache: a model's
    layers times K and V make tens of tensors, and an indexed copy of each would cost more than the copies."""
    if caches and all(c.device.type == "cpu" and c.is_contiguous() for c in caches) and kernel_available():
        torch.ops.pagoda.move_kv_slots_(caches, torch.tensor(moves, dtype=torch.int64).view(-1, 2))
        return
    move_kv_slots_torch(caches, moves, block_size)


def move_kv_slots_torch(caches: list[torch.Tensor], moves: list[tuple[int, int]], block_size: int) -> None:
    for src, dst in moves:  # in order: a later move may read a slot an earlier one wrote
        sb, so, db, do = src // block_size, src % block_size, dst // block_size, dst % block_size
        for cache in caches:
            if cache.dim() == 5:  # K words [n, Hkv, D/2, block_size, 2]: the slot is dim 3
                cache[db, :, :, do] = cache[sb, :, :, so]
            else:  # [n, Hkv, block_size, ...]
                cache[db, :, do] = cache[sb, :, so]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [R, V] tensor; vectorized C++ for fp32 / bf16 CPU logits (cpu/argmax.cpp:
    torch's reduction over a 49k vocabulary costs milliseconds a step at batch sizes of tens of rows)."""
    if x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.shape[1] > 0 and x.stride(1) == 1 \
            and _use_kernel(x):
        return torch.ops.pagoda.argmax_rows(x)
    return x.argmax(dim=-1)
