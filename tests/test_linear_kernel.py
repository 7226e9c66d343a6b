"""The few-row linear kernel equals F.linear; unsupported shapes fall back."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels.linear import SMALL_M, linear, prepack, small_m_supported


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
