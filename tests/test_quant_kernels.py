"""The quantized linear op (C++ streaming kernel and torch fallback) equals dequantized-weights @ x."""
from __future__ import annotations

import pytest
import torch

from pagoda.kernels.cpu_extension import kernel_available
from pagoda.kernels.quant_linear import PackedWeight, cpp_supported, quant_linear
from pagoda.quantization.methods import quantize_weight

SHAPES = [(576, 1536, False), (64, 7, True), (96, 33, True), (1536, 65, False), (50, 9, True)]


def _case(method: str, k: int, n: int, bias: bool, group: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(n, k) / k**0.5
    pw = quantize_weight(method, w, group)
    b = torch.randn(n) if bias else None
    return pw, b


def _ref(x: torch.Tensor, pw: PackedWeight, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ pw.dequantize().double().T
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("k,n,bias", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 33])
def test_quant_linear_matches_dequantized_reference(method, k, n, bias, m):
    pw, b = _case(method, k, n, bias, seed=m)
    x = torch.randn(m, k)
    ref = _ref(x, pw, b)
    for use_cpp in ([False, True] if cpp_supported(pw) else [False]):
        out = quant_linear(x, pw, b, use_cpp=use_cpp)
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_bf16_activations_and_3d_input(method):
    pw, b = _case(method, 576, 100, True)
    x = torch.randn(2, 5, 576)
    out = quant_linear(x.bfloat16(), pw, b)
    assert out.shape == (2, 5, 100) and out.dtype == torch.bfloat16
    ref = _ref(x.bfloat16().float().reshape(10, 576), pw, b).reshape(2, 5, 100)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


# The row-major kernels (quant_linear, quant_dequantize) are portable vector code: every build has them (the avx2
# build runs this file through tests/test_kernels_avx2.py).
_ROWS = pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.quant_linear_supported(64, 64)),
                           reason="the C++ kernels did not build")


# Every row count 1-256 crosses the kernel's passes (4 activation rows a pass on AVX2, 8 on AVX-512; 4 and 2
# weight rows at a time at one and two rows) and its tile path (more rows than a pass: weights dequantized once).
_ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 31, 64, 100, 129, 256]


@_ROWS
@pytest.mark.parametrize("n", [53, 96])  # 53: the row-major kernel and its tails; 96: the build's panels
@pytest.mark.parametrize("fmt", ["int4", "int4-sym", "int4-g128", "int8", "int8-g32", "fp8"])
def test_fp32_activations_equal_the_dequantized_reference_at_every_row_count(fmt, n):
    """The property issue 21 asks for: per format and row count 1-256 the fp32-activation kernel a layer gets
    (kernel_layout: the panel kernel where the shape allows, the row-major one elsewhere) equals x @ the dequantized
    weight (within fp32 summation error), and each row equals that row computed alone, bit for bit."""
    from pagoda.kernels.quant_linear import kernel_layout

    torch.manual_seed(len(fmt) + n)
    k = 576
    w = torch.randn(n, k) / k**0.5
    method = fmt.split("-")[0]
    pw = quantize_weight(method, w, 128 if "g128" in fmt else 32)
    if fmt == "int4-sym":  # no offsets (GGUF Q4_0)
        pw = PackedWeight("int4", pw.data, pw.scales, None, pw.group_size, k)
    elif fmt == "int8-g32":  # GGUF Q8_0's grid
        pw = PackedWeight("int8", pw.data, torch.rand(n, k // 32) / 64 + 1e-3, None, 32, k)
    pw = kernel_layout(pw, torch.float32)
    assert cpp_supported(pw) and pw.layout in (("rows",) if n == 53 else ("panels16", "vpanels"))
    b = torch.randn(n)
    x = torch.randn(max(_ROW_COUNTS), k)
    alone = torch.cat([quant_linear(x[i:i + 1], pw, b, use_cpp=True) for i in range(len(x))])
    torch.testing.assert_close(alone, _ref(x, pw, b), atol=1e-4, rtol=1e-4)
    for m in _ROW_COUNTS:
        assert torch.equal(quant_linear(x[:m], pw, b, use_cpp=True), alone[:m]), f"{m} rows"


_VPANELS = pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.quant_vpanels_supported(64, 64)),
                              reason="the C++ kernels did not build")


@_VPANELS
@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("width", [8, 16, 32])
def test_vpanel_layout_round_trips_and_gathers_rows(method, width):
    """The portable panels' layout (every build's width: 8 on NEON, 16 on AVX2, 32 on AVX-512) is a permutation:
    back to rows it is the weight it came from, and rows() gathers any rows in place (a tied head's embedding)."""
    pw, _ = _case(method, 128, 64, False, 32)
    vp = pw.vpanels(width)
    assert (vp.layout, vp.out_features, vp.in_features) == ("vpanels", 64, 128)
    back = vp.row_major()
    for got, want in ((back.data, pw.data), (back.scales, pw.scales), (back.offsets, pw.offsets)):
        assert (got is None and want is None) or torch.equal(got, want)
    index = torch.tensor([63, 0, 17, 8, 8, width - 1])
    assert torch.equal(vp.rows(index).dequantize(), pw.dequantize()[index])
    if width == torch.ops.pagoda.vpanel_width():  # the build's width runs its kernel, at every row count alike
        x = torch.randn(40, 128)
        alone = torch.cat([quant_linear(x[i:i + 1], vp, None, use_cpp=True) for i in range(len(x))])
        torch.testing.assert_close(alone, _ref(x, pw, None), atol=1e-4, rtol=1e-4)
        for m in (2, 4, 5, 8, 12, 13, 40):  # streamed, one tile pass, passes and a partial one
            assert torch.equal(quant_linear(x[:m], vp, None, use_cpp=True), alone[:m]), f"{m} rows"


@_VPANELS
@pytest.mark.parametrize("method", ["int4", "int4-sym", "int8"])
def test_vpanels_keep_fp16_scales_where_exact_and_compute_the_same_bits(method):
    """Scales and offsets that are fp16 numbers (a GGUF's Q4_0/Q4_1/Q8_0 blocks) are kept in fp16 in the portable
    panels, half their bytes, and the kernel widens them exactly: the same bits as fp32 scales at every row count.
    Others (a float checkpoint quantized here) stay fp32."""
    fmt, sym = method.split("-")[0], method.endswith("sym")
    pw, b = _case(fmt, 256, 2 * torch.ops.pagoda.vpanel_width(), True, 32)
    if sym and pw.offsets is not None:
        pw = PackedWeight(pw.format, pw.data, pw.scales, None, pw.group_size, pw.in_features)
    width = torch.ops.pagoda.vpanel_width()
    assert pw.vpanels(width).scales.dtype == torch.float32  # RTN scales are not fp16 numbers
    halves = PackedWeight(pw.format, pw.data, pw.scales.half().float(),
                          None if pw.offsets is None else pw.offsets.half().float(), pw.group_size, pw.in_features)
    vp = halves.vpanels(width)
    assert vp.scales.dtype == torch.float16 and (vp.offsets is None or vp.offsets.dtype == torch.float16)
    as_fp32 = PackedWeight(vp.format, vp.data, vp.scales.float(), None if vp.offsets is None else vp.offsets.float(),
                           vp.group_size, vp.in_features, "vpanels")
    assert vp.nbytes < as_fp32.nbytes
    assert torch.equal(vp.row_major().dequantize(), halves.dequantize())
    x = torch.randn(40, 256)
    for m in (1, 2, 4, 5, 13, 40):
        got = quant_linear(x[:m], vp, b, use_cpp=True)
        assert torch.equal(got, quant_linear(x[:m], as_fp32, b, use_cpp=True)), f"{m} rows"
    torch.testing.assert_close(got, _ref(x, halves, b), atol=1e-4, rtol=1e-4)


@_ROWS
@pytest.mark.parametrize("n", [43, 131])
def test_cpp_kernel_really_runs_and_covers_all_groups(n):
    # Groups of 32/64/128 and GGUF-style offsets (Q4_1: w = d*q + m) through the C++ op itself. Row counts
    # that are not a multiple of 4 take the single-row tail of the M = 1 kernel (4 weight rows per pass).
    torch.manual_seed(1)
    for g in (32, 64, 128):
        pw = quantize_weight("int4", torch.randn(n, 384), g)
        assert pw.group_size == g and cpp_supported(pw)
        for m in (1, 5, 11):  # fp32 activations: fp32 FMA path; bf16: the AVX512-BF16 dot path (K % 64 == 0)
            x = torch.randn(m, 384)
            y = torch.ops.pagoda.quant_linear(x, pw.data, pw.scales, pw.offsets, None, 0, g)
            torch.testing.assert_close(y, _ref(x, pw, None), atol=1e-4, rtol=1e-4)
            xb = x.bfloat16()
            y = torch.ops.pagoda.quant_linear(xb, pw.data, pw.scales, pw.offsets, None, 0, g)
            assert y.dtype == torch.bfloat16  # fp32 accumulation, rounded once on output
            torch.testing.assert_close(y.float(), _ref(xb.float(), pw, None), atol=2e-2, rtol=8e-3)


@_ROWS
def test_fp8_kernel_decodes_every_code():
    # All 254 finite e4m3 codes (subnormals, both signs) in one row: the bit trick must match torch's cast.
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]
    k = 256
    row = torch.zeros(k, dtype=torch.uint8)
    row[: finite.numel()] = finite
    pw = PackedWeight("fp8", row.view(1, k).clone(), torch.ones(1, 1), None, k, k)
    for j in range(0, k, 37):  # probe with one-hot inputs
        x = torch.zeros(1, k)
        x[0, j] = 1.0
        y = torch.ops.pagoda.quant_linear(x, pw.data, pw.scales, None, None, 2, k)
        assert y.item() == row[j : j + 1].view(torch.float8_e4m3fn).float().item()
    x = torch.randn(3, k)
    torch.testing.assert_close(quant_linear(x, pw, None, use_cpp=True), _ref(x, pw, None), atol=1e-3, rtol=1e-4)


@_ROWS
@pytest.mark.parametrize("method,group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32), ("fp8", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_dequantize_equals_the_reference(method, group, dtype):
    """The many-row path's weight (C++ dequantize, k order restored from INT4's nibble split)."""
    pw, _ = _case(method, 384, 37, False, group)
    w = torch.ops.pagoda.quant_dequantize(pw.data, pw.scales, pw.offsets, pw.code, pw.group_size,
                                          pw.in_features, dtype)
    assert w.dtype == dtype and w.shape == (37, 384)
    ref = pw.dequantize(torch.float32)
    # One FMA where the reference rounds twice; bf16 then rounds once more.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-6, rtol=2 ** -8)
    torch.testing.assert_close(w.float(), ref, **tol)


@_ROWS
def test_row_major_kernel_runs_every_row_count():
    """One kernel at every row count (batch invariance): many rows stream through the C++ kernel too."""
    from torch.profiler import profile

    pw, b = _case("int4", 576, 64, True, 64)
    for m in (1, 17, 300):
        x = torch.randn(m, 576).bfloat16()
        with profile() as prof:
            out = quant_linear(x, pw, b)
        ops = {e.key for e in prof.key_averages()}
        assert "pagoda::quant_linear" in ops and "pagoda::quant_dequantize" not in ops
        torch.testing.assert_close(out.float(), _ref(x.float(), pw, b), atol=3e-2, rtol=2e-2)


def _int8_activation_ref(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """What the int4x8 kernel computes, in float64: x rounded to int8 per row and 32 columns with scale
    max|x| / 127 (the kernel's float32 steps), dotted with the codes; the offsets take the exact sums of x."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    a = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(a > 0, 1 / a, torch.zeros_like(a))
    xq = torch.round(xb * inv) * a  # the int8 levels, back in x's units
    g = pw.group_size
    w = (pw.codes().view(pw.out_features, k // g, g) * pw.scales.unsqueeze(-1)).view(pw.out_features, k)
    y = xq.view(m, k).double() @ w.double().T
    if pw.offsets is not None:
        y += x.double().view(m, k // g, g).sum(-1) @ pw.offsets.double().T
    return y


@pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.int4x8_supported(64, 64)),
                    reason="int4x8 needs the C++ kernels with AVX2 (or AVX512-VNNI)")
@pytest.mark.parametrize("k,n,group", [(576, 40, 64), (1536, 136, 64), (384, 8, 128), (128, 24, 64), (640, 16, 32)])
@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_int4x8_kernel_computes_int8_activations_times_int4_weights(k, n, group, m):
    pw, b = _case("int4", k, n, True, group, seed=m)
    il = pw.interleave8()
    assert (il.format, il.layout) == ("int4", "interleave8") and il.out_features == n
    x = torch.randn(m, k) * (0.5 + 4 * torch.rand(1, k))  # uneven columns: the per-32 scales differ
    y = quant_linear(x, il, b, use_cpp=True)
    ref = _int8_activation_ref(x, pw) + b.double()
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    # ...which is the float linear up to the activations' int8 rounding (about 1% here)
    exact = _ref(x, pw, b).double()
    assert ((y.double() - exact).norm() / exact.norm()).item() < 3e-2
    yb = quant_linear(x.bfloat16(), il, b, use_cpp=True)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), _int8_activation_ref(x.bfloat16().float(), pw) + b.double(),
                               atol=3e-2, rtol=8e-3)


@pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.int4x8_supported(64, 64)),
                    reason="int4x8 needs the C++ kernels with AVX2 (or AVX512-VNNI)")
def test_int4x8_sums_stay_exact_at_the_largest_products_and_every_row_count():
    """Every code 15 against activations at +-127 (x constant per 32 columns): the largest integer sums a 32-column
    half can reach, which the AVX2 kernel keeps in int16 (16 * 15 * 127 = 30480 < 2^15) before widening; and each row
    computed among 1-20 others equals that row alone (the passes of 6 or 8 rows never change a row's sums)."""
    pw, b = _case("int4", 640, 24, True, 32)
    full = PackedWeight("int4", torch.full_like(pw.data, 0xFF), pw.scales, pw.offsets, 32, 640)
    il = full.interleave8()
    x = torch.ones(4, 640)
    x[1] = -1
    x[2, ::2] = -3  # the even columns (the low nibbles' operands) at -127, the odd ones at +42
    x[3] = torch.linspace(-5, 5, 640)
    torch.testing.assert_close(quant_linear(x, il, b, use_cpp=True).double(),
                               _int8_activation_ref(x, full) + b.double(), atol=1e-4, rtol=1e-5)
    il = pw.interleave8()
    x = torch.randn(20, 640) * (0.5 + 4 * torch.rand(1, 640))
    alone = torch.cat([quant_linear(x[i:i + 1], il, b, use_cpp=True) for i in range(len(x))])
    for m in (2, 5, 6, 7, 8, 9, 12, 13, 20):
        assert torch.equal(quant_linear(x[:m], il, b, use_cpp=True), alone[:m]), f"{m} rows"


@pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.int4a8_supported(64, 64)),
                    reason="the INT8-activation AVX2 kernel needs the C++ kernels with AVX2")
@pytest.mark.parametrize("k,n,group", [(576, 64, 32), (1536, 37, 64), (96, 5, 32), (256, 131, 128)])
def test_int4a8_kernel_computes_int8_activations_times_int4_weights(k, n, group):
    """The AVX2 kernel (layout rows_a8, what builds without VNNI run for quant_activations="int8"): the same sums as
    llama.cpp's Q4 x Q8 (x rounded to int8 per 32 columns), at every row count 1-64, each row as computed alone."""
    pw, b = _case("int4", k, n, True, group, seed=n)
    a8 = pw.rows_a8()
    assert (a8.format, a8.layout, a8.out_features) == ("int4", "rows_a8", n) and cpp_supported(a8)
    assert a8.row_major().layout == "rows" and torch.equal(a8.dequantize(), pw.dequantize())
    x = torch.randn(64, k) * (0.5 + 4 * torch.rand(1, k))  # uneven columns: the per-32 scales differ
    alone = torch.cat([quant_linear(x[i:i + 1], a8, b, use_cpp=True) for i in range(len(x))])
    torch.testing.assert_close(alone.double(), _int8_activation_ref(x, pw) + b.double(), atol=1e-4, rtol=1e-4)
    for m in (2, 3, 5, 8, 9, 17, 64):
        assert torch.equal(quant_linear(x[:m], a8, b, use_cpp=True), alone[:m]), f"{m} rows"
    if torch.ops.pagoda.int4x8_supported(k, group) and n % 8 == 0:  # the VNNI kernel computes the same sums
        torch.testing.assert_close(quant_linear(x, pw.interleave8(), b, use_cpp=True), alone, atol=1e-5, rtol=1e-5)
    yb = quant_linear(x.bfloat16(), a8, b, use_cpp=True)
    torch.testing.assert_close(yb.double(), _int8_activation_ref(x.bfloat16().float(), pw) + b.double(),
                               atol=3e-2, rtol=8e-3)


@pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.int4x8_supported(64, 64)),
                    reason="int4x8 needs the C++ kernels with AVX2 (or AVX512-VNNI)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4x8_layout_round_trips_and_dequantizes_alike(dtype):
    pw, _ = _case("int4", 640, 48, False, 64)
    il = pw.interleave8()
    back = il.row_major()
    for got, want in ((back.data, pw.data), (back.scales, pw.scales), (back.offsets, pw.offsets)):
        assert torch.equal(got, want)
    assert torch.equal(il.dequantize(), pw.dequantize())
    assert torch.equal(il.rows(torch.tensor([5, 0])).dequantize(), pw.dequantize()[[5, 0]])
    w = torch.ops.pagoda.quant_dequantize(il.data, il.scales, il.offsets, il.code, 64, 640, dtype)
    assert torch.equal(w, torch.ops.pagoda.quant_dequantize(pw.data, pw.scales, pw.offsets, 0, 64, 640, dtype))
    x = torch.randn(19, 640).to(dtype)  # the torch fallback dequantizes both alike
    torch.testing.assert_close(quant_linear(x, il, None, use_cpp=False), quant_linear(x, pw, None, use_cpp=False))


def test_int4_activation_mode_picks_the_layout():
    from pagoda.kernels.quant_linear import kernel_layout

    pw, _ = _case("int4", 576, 48, False, 64)
    f32, bf16 = torch.float32, torch.bfloat16
    # Default: float activations; bf16 and fp32 take the panels where the build has them (AVX512-BF16), else the
    # portable panels (48 rows: a multiple of every build's width but AVX-512's 32, which has the panels16).
    panels = cpp_supported(pw) and torch.ops.pagoda.quant_panels_supported(576, 64)
    want = "panels16" if panels else "vpanels" if cpp_supported(pw) else "rows"
    for dtype in (f32, bf16):
        assert (kernel_layout(pw, dtype).format, kernel_layout(pw, dtype).layout) == ("int4", want)
    odd_rows, _ = _case("int4", 576, 41, False, 64)
    assert kernel_layout(odd_rows, bf16) is odd_rows and kernel_layout(odd_rows, f32) is odd_rows  # panel columns
    q8, _ = _case("int8", 576, 48, False)  # INT8 (the INT4 methods' LM head) takes the panels too
    f8, _ = _case("fp8", 576, 48, False)
    for dtype in (f32, bf16):
        assert (kernel_layout(q8, dtype).format, kernel_layout(q8, dtype).layout) == ("int8", want)
        assert (kernel_layout(f8, dtype).format, kernel_layout(f8, dtype).layout) == ("fp8", want)
    assert kernel_layout(pw, torch.float16) is pw  # other dtypes: the torch fallback
    x8 = cpp_supported(pw) and torch.ops.pagoda.int4x8_supported(576, 64)  # AVX2 or VNNI
    avx2 = cpp_supported(pw) and torch.ops.pagoda.int4a8_supported(576, 64)
    for dtype in (f32, bf16):
        il = kernel_layout(pw, dtype, "int8")
        assert (il.format, il.layout) == ("int4", "interleave8" if x8 else "rows_a8" if avx2 else "rows")
    # Rows not in blocks of 8: the AVX2 kernel, which takes any row count
    assert kernel_layout(odd_rows, bf16, "int8").layout == ("rows_a8" if avx2 else "rows")
    int8, _ = _case("int8", 576, 40, False)
    assert kernel_layout(int8, bf16, "int8") is int8
    with pytest.raises(ValueError, match="quant_activations"):
        kernel_layout(pw, bf16, "int4")


_PANELS = pytest.mark.skipif(not (kernel_available() and torch.ops.pagoda.quant_panels_supported(64, 64)),
                             reason="INT4 panels need the C++ kernels with AVX512-BF16")


@_PANELS
@pytest.mark.parametrize("k,n,group", [(576, 960, 64), (1536, 48, 64), (128, 16, 32), (640, 112, 128), (96, 32, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13, 33, 129, 200])
@pytest.mark.parametrize("method,offsets", [("int4", True), ("int4", False), ("int8", False), ("int8", True),
                                            ("fp8", False)])
def test_panel_kernel_matches_the_dequantized_reference(k, n, group, m, method, offsets):
    """INT4 panels, INT8 codes as bf16 integers and FP8 as bf16 bit patterns, with bf16 and fp32 activations, at
    every row count (one row, two, strips of 8 and a partial strip), panel counts that leave partial tiles, groups
    of 32-128 (FP8: per channel), with and without offsets."""
    pw, b = _case(method, k, n, bias=m % 2 == 1, group=group, seed=m)
    if method == "int8":  # grouped, as GGUF's Q8_0 is, and optionally with offsets
        g = torch.rand(n, k // group) / 64 + 1e-3
        pw = PackedWeight("int8", pw.data, g, torch.randn(n, k // group) / 64 if offsets else None, group, k)
    elif method == "fp8":  # every e4m3 code, subnormals and both zeros included
        codes = torch.arange(n * k).remainder(256).view(n, k).to(torch.uint8)
        finite = codes.view(torch.float8_e4m3fn).float().isfinite()
        pw = PackedWeight("fp8", torch.where(finite, codes, 0).contiguous(), pw.scales, None, k, k)
    elif not offsets:
        pw = PackedWeight("int4", pw.data, pw.scales, None, group, k)
    p = pw.panels16()
    assert (p.format, p.layout) == (method, "panels16") and p.out_features == n and cpp_supported(p)
    x = torch.randn(m, k).bfloat16()
    out = quant_linear(x, p, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    # The codes are exact bf16 operands and the sums fp32, at every row count.
    ref = x.double() @ pw.dequantize().double().T + (0 if b is None else b.double())
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 2**-8, err  # one bf16 rounding of the output, plus fp32 summation
    out32 = quant_linear(x.float(), p, b)  # fp32 FMAs on the same operands: exact products, fp32 sums
    assert out32.dtype == torch.float32
    assert (out32.double() - ref).abs().max() / ref.abs().max() < 2**-18


@_PANELS
def test_panel_layouts_round_trip():
    pw, _ = _case("int4", 640, 48, False, 64)
    p = pw.panels16()
    assert p.data.shape == (3, 80, 64) and p.scales.shape == (3, 10, 16)
    back = p.row_major()
    for got, want in ((back.data, pw.data), (back.scales, pw.scales), (back.offsets, pw.offsets)):
        assert torch.equal(got, want)
    assert torch.equal(p.dequantize(), pw.dequantize())
    assert torch.equal(p.rows(torch.tensor([5, 0])).dequantize(), pw.dequantize()[[5, 0]])
    assert torch.equal(PackedWeight.cat([p, pw]).dequantize(), torch.cat([pw.dequantize()] * 2))
    # fp32 activations (not the panel kernel's) still get the right product, through the reference.
    x = torch.randn(3, 640)
    torch.testing.assert_close(quant_linear(x, p, None), _ref(x, pw, None), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="panels16"):
        _case("int4", 640, 40, False, 64)[0].panels16()
    q8, _ = _case("int8", 640, 48, False)
    p8 = q8.panels16()
    assert p8.data.shape == (3, 80, 128) and p8.in_features == 640  # one byte a code, as FP8's
    back = p8.row_major()
    assert (back.format, back.layout) == ("int8", "rows")
    assert torch.equal(back.data, q8.data) and torch.equal(back.scales, q8.scales)
    assert back.offsets is None and torch.equal(p8.dequantize(), q8.dequantize())
    f8, _ = _case("fp8", 64, 48, False)
    pf = f8.panels16()
    assert pf.data.shape == (3, 8, 128) and torch.equal(pf.row_major().data, f8.data)
    assert torch.equal(pf.dequantize(), f8.dequantize())
    # rows() gathers from the panels directly (a GGUF embedding shares its tied head's int8p table).
    idx = torch.tensor([47, 0, 16, 5, 5])
    for panels, rm in ((p8, q8), (p, pw), (pf, f8)):
        got, want = panels.rows(idx), rm.rows(idx)
        assert (got.format, got.layout) == (rm.format, "rows")
        assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)


@_PANELS
def test_quant_model_sweep_times_panels_against_the_row_major_kernels():
    """`quant_kernels --model-sweep int4|fp8`: every kernel computes the same product, layers and head (INT8
    activations within their rounding)."""
    from benchmarks.quant_kernels import _quant_kernels

    ws = [_case("int4", 128, 32, False, 64)[0], _case("int8", 64, 48, False)[0], _case("fp8", 64, 16, False)[0]]
    kernels = _quant_kernels(ws)
    assert list(kernels) == ["row-major", "panels", "int8-act"]
    for m in (1, 21):
        for i, pw in enumerate(ws):
            x = torch.randn(m, pw.in_features).bfloat16()
            ref = _ref(x.float(), pw, None)
            for name, fn in kernels.items():
                if name == "int8-act" and pw.format == "int4":
                    assert ((fn(x, i).float() - ref).norm() / ref.norm()).item() < 3e-2
                else:
                    torch.testing.assert_close(fn(x, i).float(), ref, atol=2e-2, rtol=1e-2)


def test_linear_formats_come_from_the_header_cpp_compiles():
    """One table (cpu/linear_formats.h): Python's codes are the enum the decoder stack and kernels dispatch on;
    each quantized code is one (format, layout), or GGUF vpanels read by another driver (AMX tiles, int8
    activations), and every PackedWeight has one."""
    from pagoda.kernels.linear_formats import (
        _HEADER,
        FIRST_PANEL_CODE,
        GGUF_DRIVER_CODES,
        LINEAR_FORMATS,
        QUANT_CODES,
        _read,
    )

    assert _read(_HEADER) == LINEAR_FORMATS and len(set(LINEAR_FORMATS.values())) == len(LINEAR_FORMATS)
    assert LINEAR_FORMATS["dense"] < 0 and LINEAR_FORMATS["panels"] < 0
    codes = [*QUANT_CODES.values(), *GGUF_DRIVER_CODES.values()]
    assert sorted(codes) == sorted(c for c in LINEAR_FORMATS.values() if c >= 0)
    kinds = [QUANT_CODES[f, "panels16"] - FIRST_PANEL_CODE for f in ("int4", "int8", "fp8")]
    assert kinds == [0, 1, 2]  # quant_panel_linear's kinds
    with pytest.raises(ValueError, match="interleave8"):
        PackedWeight("int8", torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1), None, 64, 64, "interleave8")
    for driver in GGUF_DRIVER_CODES:
        with pytest.raises(ValueError, match="only GGUF blocks"):
            PackedWeight("int8", torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1), None, 64, 64,
                         gguf_driver=driver)
