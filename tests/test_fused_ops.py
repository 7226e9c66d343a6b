"""Fused C++ ops equal their torch fallbacks (and HF's math) in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels import fused_ops
from pagoda.kernels.cpu_extension import kernel_available


def test_cpp_kernels_build_on_this_machine():
    assert kernel_available(), "the C++ kernels failed to build: see the warning in the log"


@pytest.fixture
def fallback(monkeypatch):
    monkeypatch.setattr(fused_ops, "_use_kernel", lambda x: False)


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_with_and_without_residual(dtype, tol):
    torch.manual_seed(0)
    x, res, w = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
    r = res.clone()
    out = fused_ops.rms_norm(x, w, 1e-5, r)
    torch.testing.assert_close(r, res + x, atol=tol, rtol=0)
    torch.testing.assert_close(out, hf_rms_norm(res + x, w, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(dtype, tol, monkeypatch):
    torch.manual_seed(0)
    Hq, Hkv, D, T = 4, 2, 16, 5
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dtype)
    pos = torch.tensor([0, 3, 7, 8, 20])
    ang = torch.outer(torch.arange(32).float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = ang.cos(), ang.sin()
    kernel = qkv.clone()
    fused_ops.rope_(kernel, pos, cos, sin, Hq, Hkv, D)
    monkeypatch.setattr(fused_ops, "_use_kernel", lambda x: False)
    ref = qkv.clone()
    fused_ops.rope_(ref, pos, cos, sin, Hq, Hkv, D)
    torch.testing.assert_close(kernel, ref, atol=tol, rtol=tol)
    assert torch.equal(kernel[:, (Hq + Hkv) * D:], qkv[:, (Hq + Hkv) * D:])
    assert not torch.allclose(kernel[1:, : Hq * D].float(), qkv[1:, : Hq * D].float())
    # position 0 is the identity rotation
    torch.testing.assert_close(kernel[0], qkv[0])


@pytest.mark.parametrize("kernel", [True, False])
def test_partial_rope_rotates_the_table_width_as_transformers_phi3(kernel, monkeypatch):
    """A [max_pos, R/2] table rotates each head's first R dims (pairs i, i + R/2); the other D - R pass through."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    torch.manual_seed(0)
    Hq, Hkv, D, R, T = 4, 2, 16, 12, 5
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    pos = torch.tensor([0, 3, 7, 8, 20])
    ang = torch.outer(torch.arange(32).float(), 1.0 / 10000 ** (torch.arange(0, R, 2).float() / R))
    cos, sin = ang.cos() * 1.2, ang.sin() * 1.2  # LongRoPE scales the table
    if not kernel:
        monkeypatch.setattr(fused_ops, "_use_kernel", lambda x: False)
    out = qkv.clone()
    fused_ops.rope_(out, pos, cos, sin, Hq, Hkv, D)
    q = qkv[:, : Hq * D].view(T, Hq, D).transpose(0, 1)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D).transpose(0, 1)
    c, s = torch.cat((cos, cos), -1)[pos], torch.cat((sin, sin), -1)[pos]
    q_ref, k_ref = apply_rotary_pos_emb(q[None], k[None], c[None], s[None])
    torch.testing.assert_close(out[:, : Hq * D], q_ref[0].transpose(0, 1).reshape(T, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, Hq * D: (Hq + Hkv) * D], k_ref[0].transpose(0, 1).reshape(T, -1),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(out.view(T, -1, D)[:, : Hq + Hkv, R:], qkv.view(T, -1, D)[:, : Hq + Hkv, R:])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul(dtype, tol):
    x = torch.randn(6, 2 * 40, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(x), F.silu(gate) * up, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul_vectorized_exp_over_the_full_range(dtype, tol):
    """The AVX-512 path's own exp: from deep saturation (e^-x overflows / underflows) to tiny gates."""
    gate = torch.cat([torch.linspace(-120, 120, 1000), torch.tensor([0.0, 1e-30, -1e-30, 88.5, -88.5, 87.0])])
    x = torch.cat([gate, torch.randn(gate.shape[0]) * 3]).view(1, -1).to(dtype)
    g, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(x), F.silu(g) * up, atol=tol, rtol=tol)


def test_fallbacks_match_kernels(fallback):
    x, w = torch.randn(3, 32), torch.randn(32)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))
    y = torch.randn(3, 20)
    torch.testing.assert_close(fused_ops.silu_and_mul(y), F.silu(y[:, :10]) * y[:, 10:])


@pytest.mark.skipif(not kernel_available(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (5, 1000), (3, 7), (64, 517)])
def test_argmax_rows_equals_torch_argmax(rows, vocab, dtype):
    """First index of the maximum on ties (lanes merged by index), first NaN where a row has one,
    -inf rows, vocabularies below one vector and with a ragged tail; bf16 logits (greedy steps) as is."""
    torch.manual_seed(rows)
    x = torch.randn(rows, vocab).to(dtype)  # bf16: many ties, the first must win
    x[0, vocab // 3] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first must win
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, vocab // 2] = x[2, vocab // 4] = float("nan")
    if rows > 3:
        x[3, :] = 0.5  # all equal
    assert torch.equal(torch.ops.pagoda.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(fused_ops.argmax_rows(x[:, : vocab - 1]), x[:, : vocab - 1].argmax(dim=-1))  # strided rows


# The kernels run W = 16 (AVX-512), 8 (AVX2) or 4 (NEON) lanes at a time with scalar tails: widths around each
# multiple, and row counts on both sides of the parallel grain (16).
WIDTHS = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 100]
ROWS = [1, 2, 17, 40]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_every_tail(rows, dtype, tol):
    torch.manual_seed(rows)
    for dim in [*WIDTHS, 579]:
        x, res = torch.randn(2, rows, dim, dtype=dtype)
        w = torch.randn(dim, dtype=dtype)
        torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-5), hf_rms_norm(x, w, 1e-5), atol=tol, rtol=tol)
        r = res.clone()
        out = fused_ops.rms_norm(x, w, 1e-5, r)
        assert torch.equal(r, res + x), dim  # the sum rounded to the dtype once, as torch's add
        torch.testing.assert_close(out, hf_rms_norm(res + x, w, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_every_tail_rounds_as_the_unfused_ops(rows, dtype):
    """bf16: silu(gate) rounded to bf16, then times up rounded again, as F.silu(gate) * up (at most one ulp apart
    where the exps differ in the last fp32 bit)."""
    torch.manual_seed(rows)
    for inter in WIDTHS:
        x = (torch.randn(rows, 2 * inter) * 4).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        got, want = fused_ops.silu_and_mul(x), F.silu(gate) * up
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=2e-6)
        else:
            assert (got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max() <= 1, inter
            assert (got == want).float().mean() > 0.98, inter


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("D,R", [(64, 64), (64, 48), (80, 80), (16, 12), (8, 8), (34, 34), (96, 36)])
def test_rope_every_tail(D, R, dtype, tol):
    torch.manual_seed(D + R)
    Hq, Hkv, T = 3, 2, 19
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dtype)
    pos = torch.randint(0, 64, (T,))
    ang = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, R, 2).float() / R))
    got, want = qkv.clone(), qkv.clone()
    fused_ops.rope_(got, pos, ang.cos(), ang.sin(), Hq, Hkv, D)
    fused_ops.rope_torch_(want, pos, ang.cos(), ang.sin(), Hq, Hkv, D)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got.view(T, -1, D)[:, :, R:], qkv.view(T, -1, D)[:, :, R:])


@pytest.mark.skipif(not kernel_available(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", WIDTHS)
def test_argmax_rows_every_tail(vocab, dtype):
    """The maximum, a tie or a NaN in the vector part or in the scalar tail, on every row count."""
    torch.manual_seed(vocab)
    x = torch.randn(40, vocab).to(dtype)
    for r in range(0, 40, 4):
        j, k = (r * 7) % vocab, (r * 13 + 5) % vocab
        x[r, j] = x[r, k] = 10.0  # a tie (or one maximum where j == k)
        if r % 8 == 4:
            x[r + 1, k] = float("nan")
        if r % 12 == 8:
            x[r + 2, j] = float("nan")
            x[r + 2, k] = float("inf")
        x[r + 3] = float("-inf")
    for rows in ROWS:
        assert torch.equal(torch.ops.pagoda.argmax_rows(x[:rows]), x[:rows].argmax(dim=-1)), rows


@pytest.mark.skipif(not kernel_available(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_kv_write_every_tail_stores_the_torch_bytes(dtype, cache_dtype):
    """The KV write's amax and scaling run W lanes at a time: head dims around each multiple of W store the same
    bytes and scales as the torch twin (an all-zero row, an outlier, saturation of fp8_e4m3 by the scale)."""
    torch.manual_seed(0)
    for D in [1, 3, 8, 12, 20, 40, 64, 100]:
        k, v = (torch.randn(2, 9, 2, D) * torch.logspace(-3, 1, 9)[None, :, None, None]).to(dtype)
        k[0, 0] = 0
        v[..., 0] *= 50
        slots = torch.randperm(12)[:9]
        stores = []
        for write in (fused_ops.write_kv_cache, fused_ops.write_kv_cache_torch):
            kc, vc = (torch.zeros(3, 2, 4, D, dtype=torch.int8).view(cache_dtype) for _ in range(2))
            ks, vs = torch.zeros(3, 2, 4), torch.zeros(3, 2, 4)
            write(k, v, kc, vc, slots, ks, vs)
            stores.append((kc.view(torch.uint8), vc.view(torch.uint8), ks, vs))
        for a, b in zip(*stores):
            assert torch.equal(a, b), D


@pytest.mark.skipif(not kernel_available(), reason="the C++ kernels did not build")
def test_kv_slot_moves_copy_what_the_torch_twin_copies_in_every_cache_layout():
    """A draft tree's accepted nodes move to their positions' slots in every layer: K as rows or as words, V, and
    an 8-bit pool's scales, in one call. Moves run in order (the second reads the slot the first wrote) and touch
    nothing else."""
    torch.manual_seed(0)
    n, H, bs, D = 5, 3, 16, 8
    caches = [torch.randn(n, H, bs, D, dtype=torch.bfloat16),             # V, or K as rows
              torch.randn(n, H, D // 2, bs, 2, dtype=torch.bfloat16),     # K as words
              torch.randn(n, H, bs, D).to(torch.float8_e4m3fn),           # an 8-bit pool
              torch.rand(n, H, bs)]                                       # its scales
    moves = [(2 * bs + 5, 17), (17, 3 * bs + 15), (4 * bs, 4 * bs + 1)]
    want = [c.clone() for c in caches]
    fused_ops.move_kv_slots_torch(want, moves, bs)
    fused_ops.move_kv_slots(caches, moves, bs)
    for got, ref in zip(caches, want):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    # the torch twin itself moved what it should: slot 3 * bs + 15 holds what slot 2 * bs + 5 held
    assert torch.equal(want[0][3, :, 15], want[0][2, :, 5]) and torch.equal(want[1][3, :, :, 15], want[1][2, :, :, 5])


def test_fused_ops_bench_times_every_op(capsys):
    """`benchmarks/fused_ops.py` (docs/benchmarks.md's fused-op figures) calls each op at its shapes."""
    from benchmarks.fused_ops import main

    assert main(["--rows", "1,3", "--calls", "1", "--rounds", "1", "--threads", str(torch.get_num_threads())]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "T=" in line]
    assert len(lines) == 4 and all(op in lines[0] for op in ("rms_norm+res", "silu_and_mul", "rope", "argmax",
                                                               "write_kv int8"))
