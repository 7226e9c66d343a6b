"""The dense linear kernels (few-row streaming, oneDNN prepacked, pair-packed bf16) equal F.linear;
unsupported shapes fall back."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels.linear import SMALL_M, linear, pair_pack, prepack, small_m_supported


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9])
@pytest.mark.parametrize("k,n,bias", [(576, 1536, False), (64, 7, True), (96, 200, True)])
def test_small_m_linear_matches_f_linear(dtype, tol, m, k, n, bias):
    if not small_m_supported(dtype, k):
        pytest.skip(f"no small-M kernel for {dtype} on this CPU")
    torch.manual_seed(m)
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k**0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    out = linear(x, w, b, small_m_ok=True)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    if m <= SMALL_M:  # guard: the kernel really ran (a wrong kernel must fail above)
        assert torch.ops.pagoda.small_m_linear(x, w, b).shape == (m, n)


def test_unsupported_inner_size_falls_back_to_f_linear():
    assert not small_m_supported(torch.float32, 15)
    x, w = torch.randn(2, 15), torch.randn(4, 15)
    torch.testing.assert_close(linear(x, w, None, small_m_ok=False), F.linear(x, w))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m", [SMALL_M + 1, 37, 200])
def test_prepacked_weight_matches_f_linear(dtype, tol, m):
    """Above SMALL_M rows the layer multiplies by oneDNN's prepacked weight (packed for 64 rows,
    valid for any): the result is F.linear's."""
    torch.manual_seed(m)
    w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    packed = prepack(w)
    if packed is None:
        pytest.skip("oneDNN unavailable")
    x = torch.randn(m, 64).to(dtype)
    out = linear(x, w, b, small_m_ok=False, packed=packed)
    assert out.dtype == dtype and out.shape == (m, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=tol, rtol=tol)
    assert prepack(w.to(torch.float16)) is None  # other dtypes keep F.linear


needs_pairs = pytest.mark.skipif(not small_m_supported(torch.bfloat16, 32), reason="needs AVX512-BF16 kernels")


@needs_pairs
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20, 64, 200])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (2, 16, True), (30, 32, False), (96, 80, True),
                                      (1536, 112, True)])
def test_pair_packed_linear_matches_f_linear(m, k, n, bias):
    """Every row count (tiles of 8 rows and the remainder), whole and partial 48-column tiles (N = 16, 32,
    80, 112), odd K/2, bias or not: the fp32 product of the same bf16 inputs, rounded once to bf16."""
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k).bfloat16()
    w = (torch.randn(n, k) / k**0.5).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    pairs = pair_pack(w)
    assert pairs is not None and pairs.shape == (n // 16, k // 2, 16, 2)
    assert torch.equal(pairs[1 % (n // 16), 0, 3], w[16 * (1 % (n // 16)) + 3, :2])  # the layout itself
    out = linear(x, w, b, small_m_ok=False, pairs=pairs)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=8e-3)  # bf16 rounding of the output


@needs_pairs
def test_pair_pack_declines_what_the_kernel_cannot_take():
    assert pair_pack(torch.randn(32, 64)) is None                      # fp32: oneDNN / streaming kernel
    assert pair_pack(torch.randn(24, 64).bfloat16()) is None           # N not a multiple of 16
    assert pair_pack(torch.randn(32, 63).bfloat16()) is None           # odd K
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.pagoda.packed_linear(torch.randn(2, 62).bfloat16(), pair_pack(torch.randn(32, 64).bfloat16()))
