"""Paged attention over a block-structured KV cache (CPU).

`paged_attention` runs a C++ kernel (compiled lazily on first use, cached on disk
across processes) and falls back to `paged_attention_reference`, a simple pure-torch
version, when the kernel cannot be built or `PAGODA_DISABLE_CPP_KERNELS=1`.

Cache layout: ``[num_blocks, Hkv, block_size, D]``; a token at position ``j`` of
sequence ``b`` lives at ``cache[block_tables[b, j // block_size], :, j % block_size]``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "cpu" / "paged_attention.cpp"]
_EXT_NAME = "pagoda_cpu_kernels"
# -fopenmp: at::parallel_for is a header template whose `omp parallel` is only active
# when this translation unit is compiled with OpenMP. The .so then needs libgomp.so.1,
# which resolves to the copy torch already loaded (same soname): one thread pool.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "warned": False}


def _disabled() -> bool:
    return os.environ.get("PAGODA_DISABLE_CPP_KERNELS", "0") not in ("", "0", "false", "False")


def _cpu_fingerprint() -> str:
    """-march=native output is CPU specific: a shared home dir must not reuse a build."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    """Per source/torch/CPU build dir, so every process reuses one compiled library."""
    h = hashlib.sha256()
    for src in _SOURCES:
        h.update(src.read_bytes())
    for part in (torch.__version__, " ".join(_CFLAGS), " ".join(_LDFLAGS), _cpu_fingerprint()):
        h.update(part.encode())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagoda" / "torch_extensions"
    return root / h.hexdigest()[:16]


def _load() -> bool:
    """Compile (or reuse) the extension and register torch.ops.pagoda.*; True on success."""
    if _state["tried"]:  # hot path: no lock once decided
        return bool(_state["ok"])
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        try:
            from torch.utils import cpp_extension

            build_dir = build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            # torch's file baton in build_dir serializes concurrent builds; a later
            # process finds ninja up to date and only loads the .so.
            cpp_extension.load(
                name=_EXT_NAME,
                sources=[str(s) for s in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            logger.debug("pagoda C++ kernels ready in %.1fs (%s)", time.perf_counter() - t0, build_dir)
            _state["ok"] = hasattr(torch.ops.pagoda, "paged_attention")
        except Exception as e:  # any build/load failure means: use the torch fallback
            logger.warning("pagoda C++ kernels unavailable (%s: %s); using the pure-torch fallback",
                           type(e).__name__, e)
            _state["warned"] = True
            _state["ok"] = False
        _state["tried"] = True  # only now, so the lock-free check never sees a half-done build
        return bool(_state["ok"])


def kernel_available() -> bool:
    """True when the C++ kernel is enabled and compiled (triggers the lazy build)."""
    return not _disabled() and _load()


def _kernel_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == q.dtype and q.shape[-1] % 16 == 0 and k_cache.stride(-1) == 1)


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
) -> torch.Tensor:
    """Causal varlen attention of flat queries ``q [T, Hq, D]`` over the paged cache.

    Query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and
    sees keys ``0..`` that position. Returns ``[T, Hq, D]`` in ``q``'s dtype.
    """
    if kernel_available() and _kernel_supports(q, k_cache):
        return torch.ops.pagoda.paged_attention(
            q.contiguous(), k_cache, v_cache, _i32(block_tables), _i32(query_start_loc),
            _i32(seq_lens), float(scale))
    if not _disabled() and not _state["warned"]:
        _state["warned"] = True
        logger.warning("paged_attention: C++ kernel not used for dtype=%s D=%d; using the torch reference",
                       q.dtype, q.shape[-1])
    return paged_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Pure-torch paged attention: per sequence, gather its blocks and apply a causal mask."""
    T, Hq, D = q.shape
    _, Hkv, bs, _ = k_cache.shape
    group = Hq // Hkv
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        blocks = block_tables[b, : (seq_len + bs - 1) // bs].long()
        # [n, Hkv, bs, D] -> [Hkv, n*bs, D] -> first seq_len keys, one copy per query head.
        k = k_cache[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :seq_len].float()
        v = v_cache[blocks].transpose(0, 1).reshape(Hkv, -1, D)[:, :seq_len].float()
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        qb = q[q0:q1].transpose(0, 1).float()  # [Hq, q_len, D]
        scores = (qb @ k.transpose(1, 2)) * scale  # [Hq, q_len, seq_len]
        pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        allowed = torch.arange(seq_len).unsqueeze(0) <= pos
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store token t's ``k[t], v[t]`` (``[Hkv, D]``) at cache slot ``slot_mapping[t]``.

    slot = block * block_size + offset, so the token lands at ``cache[block, :, offset]``.
    """
    bs = k_cache.shape[2]
    slots = slot_mapping.long()
    blocks = torch.div(slots, bs, rounding_mode="floor")
    offsets = slots - blocks * bs
    # Two advanced indices around a slice: the indexed view is [T, Hkv, D], matching k.
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)
