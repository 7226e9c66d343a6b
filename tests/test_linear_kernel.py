"""The dense linear kernels (few-row streaming, oneDNN prepacked, panel-packed) equal F.linear;
unsupported shapes fall back."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.quant_kernels import _dense_kernels
from pagoda.kernels.linear import SMALL_M, linear, panel_pack, prepack, small_m_supported


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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20, 64, 200])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (2, 16, True), (30, 32, False), (96, 80, True),
                                      (1536, 112, True)])
def test_panel_packed_linear_matches_f_linear(dtype, tol, m, k, n, bias):
    """Every row count (tiles of 8 rows and the remainder), whole and partial 48-column tiles (N = 16, 32,
    80, 112), odd K/2, bias or not: the fp32 product of the same inputs, rounded once to the dtype."""
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    panels = panel_pack(w)
    if panels is None:
        pytest.skip(f"no packed kernel for {dtype} on this CPU")
    pairs = 2 if dtype == torch.bfloat16 else 1  # bf16 panels hold pairs along K, as vdpbf16ps reads them
    p = 1 % (n // 16)
    assert panels.reshape(n // 16, k // pairs, 16, pairs)[p, 0, 3].tolist() == w[16 * p + 3, :pairs].tolist()
    out = linear(x, w, b, small_m_ok=False, panels=panels)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_panel_pack_declines_what_the_kernel_cannot_take():
    assert panel_pack(torch.randn(24, 64)) is None                     # N not a multiple of 16
    assert panel_pack(torch.randn(32, 63)) is None                     # odd K
    assert panel_pack(torch.randn(32, 64).half()) is None              # fp16: F.linear
    panels = panel_pack(torch.randn(32, 64))
    if panels is not None:
        with pytest.raises(RuntimeError, match="columns"):
            torch.ops.pagoda.packed_linear(torch.randn(2, 62), panels)


@pytest.mark.skipif(not small_m_supported(torch.bfloat16, 64), reason="needs AVX512-BF16 kernels")
def test_model_sweep_times_panels_against_the_kernel_they_replaced():
    """`quant_kernels --model-sweep`: the streaming kernel up to SMALL_M rows, oneDNN above, then panels;
    all computing the same product."""
    ws = [(torch.randn(32, 64) / 8).bfloat16(), (torch.randn(48, 64) / 8).bfloat16()]
    for m, before in ((SMALL_M, "streaming"), (SMALL_M + 12, "oneDNN prepacked")):
        kernels = _dense_kernels(torch.bfloat16, ws, m)
        assert list(kernels) == [before, "panels"]
        x = torch.randn(m, 64).bfloat16()
        for i, w in enumerate(ws):
            ref = F.linear(x.float(), w.float())
            for fn in kernels.values():
                torch.testing.assert_close(fn(x, i).float(), ref, atol=1e-2, rtol=8e-3)


def test_one_kernel_record_per_layer_from_the_weight_dtype_and_policy():
    from pagoda.kernels.cpu_extension import kernel_available
    from pagoda.kernels.linear import ANY_M
    from pagoda.kernels.linear_formats import DENSE, LINEAR_FORMATS, PANELS
    from pagoda.kernels.linear_kernel import choose_linear_kernel
    from pagoda.kernels.policy import TORCH_ONLY, KernelPolicy
    from pagoda.kernels.quant_linear import cpp_supported
    from pagoda.quantization.methods import quantize_weight

    w, x = torch.randn(64, 128), torch.randn(3, 128)
    torch_only = choose_linear_kernel(w, None, None, torch.float32, TORCH_ONLY)
    assert (torch_only.code, torch_only.cpp, torch_only.panels, torch_only.stack_args()) == (DENSE, False, None, None)
    torch.testing.assert_close(torch_only.run(x), F.linear(x, w))
    if not kernel_available():
        return
    auto = KernelPolicy.resolve()
    dense = choose_linear_kernel(w, None, None, torch.float32, auto)
    assert dense.code == (PANELS if panel_pack(w) is not None else DENSE)
    if dense.code == PANELS:
        assert dense.stack_args()[1:] == (PANELS, 0, ANY_M)
    torch.testing.assert_close(dense.run(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
    pw = quantize_weight("int4", w, 32)
    for dtype in (torch.float32, torch.bfloat16):
        q = choose_linear_kernel(None, pw, None, dtype, auto)
        if q.qweight.layout == "panels16":  # the panel kernel serves every row count, fp32 and bf16
            assert q.code == LINEAR_FORMATS["int4p"] and q.stack_rows == ANY_M
        elif q.qweight.layout == "vpanels":  # the portable panel kernel (builds without AVX512-BF16)
            assert q.code == LINEAR_FORMATS["int4v"] and q.stack_rows == ANY_M
        else:  # so does the row-major streaming kernel (or none: the torch fallback)
            assert q.qweight is pw and q.code == LINEAR_FORMATS["int4"]
            assert q.stack_rows == (ANY_M if cpp_supported(pw) else 0)
    odd = quantize_weight("int4", torch.randn(40, 128), 32)  # rows not a multiple of 16: no panels
    q40 = choose_linear_kernel(None, odd, None, torch.float32, auto)
    assert q40.qweight is odd and q40.stack_rows == (ANY_M if cpp_supported(odd) else 0)


def _amx() -> bool:
    from pagoda.kernels.cpu_extension import kernel_available

    return kernel_available() and torch.ops.pagoda.amx_available()


@pytest.mark.skipif(not _amx(), reason="the CPU (or this build) has no AMX-BF16")
@pytest.mark.parametrize("k,n", [(576, 192), (1536, 576), (64, 48)])
def test_bf16_panels_run_on_amx_with_one_order_at_every_row_count(k: int, n: int) -> None:
    """Where the CPU has AMX, bf16 panels run on its tiles (cpu/amx_tile.h): a row's result is the same bits
    alone and inside batches of any size (a strip of 16 padded with zero rows included), and the sums are
    fp32's within bf16 rounding of the output."""
    torch.manual_seed(0)
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    panels = panel_pack(w)
    x = torch.randn(40, k).bfloat16()
    full = linear(x, w, b, False, panels=panels)
    assert torch.equal(full, torch.ops.pagoda.amx_linear(x, panels, b))
    for m in (1, 2, 15, 16, 17, 33):
        assert torch.equal(linear(x[:m], w, b, False, panels=panels), full[:m])
    assert torch.equal(linear(x[21:22], w, b, False, panels=panels)[0], full[21])
    ref = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(full.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
