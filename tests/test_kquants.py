"""GGUF's Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0, Q2_K, Q3_K, IQ4_XS and MXFP4 in their blocks'
bits (format "gguf", kernels/gguf_blocks.py): the C++ kernel computes gguf-py's dequantized weights times x at every
row count, with the same bits for a row whatever the batch, and a tiny Llama GGUF of Q4_K/Q6_K tensors runs them as
stored, generating what its float copy does."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagoda.bench.quant_table import weight_bytes_by_format
from pagoda.kernels import gguf_blocks
from pagoda.kernels.linear_formats import LINEAR_FORMATS
from pagoda.kernels.quant_linear import PackedWeight, kernel_layout, quant_linear
from pagoda.quantization.gguf_native import packed_from_blocks, stored_weight

# Byte offsets of the fp16 fields (d, dmin) of the types gguf-py cannot quantize: random bytes there could be inf
# or NaN.
FP16_FIELDS = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.Q2_K: [80, 82], T.Q3_K: [108],
               T.IQ4_XS: [0]}
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4)  # gguf-py has their quantizers
TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q8_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4]
BLOCKS_OF_32 = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q8_0, T.MXFP4}
ROWS = (1, 3, 17, 64)


def random_blocks(qtype: T, rows: int, k: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    """Valid blocks of `qtype`, uint8 [rows, bytes]: gguf-py's quantizer where it has one (QUANTIZABLE), else random
    bytes (every code and sub-block scale) with finite fp16 scales in [-scale, scale]."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        return quantize(rng.standard_normal((rows, k)).astype(np.float32) * scale, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = rng.uniform(-scale, scale, size=raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32)).reshape(raw.shape[0], -1)


def prepared(raw: np.ndarray, qtype: T, k: int, act: torch.dtype = torch.float32) -> PackedWeight:
    pw = kernel_layout(stored_weight(raw, int(qtype), k), act)
    assert (pw.format, pw.layout) == ("gguf", "vpanels")
    return pw


def assert_sums_of(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float) -> None:
    """got == x @ w^T up to fp32 summation: within rel x (|x| @ |w|^T), elementwise, of the float64 product."""
    want = x.double() @ w.double().T
    bound = rel * (x.double().abs() @ w.double().abs().T) + 1e-30
    worst = ((got.double() - want).abs() / bound).max().item()
    assert worst <= 1, f"off by {worst:.2f} x the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_gguf_py_weights_times_x_at_every_row_count(qtype: T) -> None:
    n, k = 96, 512  # three panels of the widest build: an odd one after the pairs one-row decode takes
    raw = random_blocks(qtype, n, k)
    ref = reference(raw, qtype)
    pw = prepared(raw, qtype, k)
    torch.testing.assert_close(pw.dequantize(), ref, rtol=0, atol=0)  # the panels hold gguf-py's very weights
    x = torch.randn(max(ROWS), k)
    full = quant_linear(x, pw, None)
    for m in ROWS:
        got = quant_linear(x[:m], pw, None)
        assert_sums_of(got, x[:m], ref, 1e-5)
        assert torch.equal(got, full[:m])  # batch invariance: a row's bits do not depend on the rows beside it


def assert_bf16_of(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float = 2e-5) -> None:
    """got (bf16) == x @ w^T rounded once to bf16: within half a bf16 unit of the float64 product (2^-8 of it) plus
    rel x (|x| @ |w|^T) for the fp32 sums, elementwise."""
    want = x.double() @ w.double().T
    bound = 2 ** -8 * want.abs() + rel * (x.double().abs() @ w.double().abs().T) + 1e-30
    worst = ((got.double() - want).abs() / bound).max().item()
    assert worst <= 1, f"off by {worst:.2f} x the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_activations_dot_the_codes_with_the_same_sums_at_every_row_count(qtype: T) -> None:
    """bf16 x: the codes as bf16 numbers in dot products with x (the AVX512-BF16 builds), scales and offsets in each
    group's epilogue: gguf-py's weights times x rounded once, and a row's bits whatever rows share the call."""
    n, k = 96, 512 if qtype not in BLOCKS_OF_32 else 96
    raw = random_blocks(qtype, n, k, seed=1)
    ref = reference(raw, qtype)
    pw = prepared(raw, qtype, k, torch.bfloat16)
    x = torch.randn(max(ROWS), k).bfloat16()
    full = quant_linear(x, pw, None)
    assert full.dtype == torch.bfloat16
    for m in ROWS:
        got = quant_linear(x[:m], pw, None)
        assert torch.equal(got, full[:m])  # batch invariance
        assert_bf16_of(got, x[:m].float(), ref)
        assert torch.equal(quant_linear(x[m - 1:m], pw, None), full[m - 1:m])  # the last row alone


def test_bias_and_a_fused_weight_of_two_types() -> None:
    """q|k|v of Q4_K and Q6_K parts: one weight of two segments, each through its own decoder, bias added once."""
    k = 256
    a, b = random_blocks(T.Q4_K, 64, k, seed=2), random_blocks(T.Q6_K, 32, k, seed=3)
    fused = PackedWeight.cat([stored_weight(a, int(T.Q4_K), k), stored_weight(b, int(T.Q6_K), k)])
    ref = torch.cat([reference(a, T.Q4_K), reference(b, T.Q6_K)])
    torch.testing.assert_close(fused.dequantize(), ref, rtol=0, atol=0)
    pw = kernel_layout(fused, torch.float32)
    bias = torch.randn(96)
    x = torch.randn(5, k)
    assert_sums_of(quant_linear(x, pw, bias) - bias, x, ref, 2e-5)
    rows = torch.tensor([95, 0, 70, 3, 64])  # an embedding's lookups, across the segments, from both layouts
    torch.testing.assert_close(pw.dequantize_rows(rows), ref[rows], rtol=0, atol=0)
    torch.testing.assert_close(fused.dequantize_rows(rows), ref[rows], rtol=0, atol=0)


def test_bf16_activations_through_a_weight_of_every_type_with_bias() -> None:
    """One fused weight of a segment of each type, bf16 x: each segment through its own decoder into its columns,
    the bias added once, at every row count with the same bits per row."""
    k = 256
    parts = [(qtype, random_blocks(qtype, 32 * (i % 2 + 1), k, seed=10 + i)) for i, qtype in enumerate(TYPES)]
    fused = PackedWeight.cat([stored_weight(raw, int(qtype), k) for qtype, raw in parts])
    ref = torch.cat([reference(raw, qtype) for qtype, raw in parts])
    pw = kernel_layout(fused, torch.bfloat16)
    assert [t for t, _, _ in gguf_blocks.segments(pw.scales)] == [int(t) for t in TYPES]
    bias = torch.randn(ref.shape[0])
    x = torch.randn(max(ROWS), k).bfloat16()
    full = quant_linear(x, pw, bias)
    for m in ROWS:
        got = quant_linear(x[:m], pw, bias)
        assert torch.equal(got, full[:m])
        assert_bf16_of(got, torch.cat([x[:m].float(), torch.ones(m, 1)], 1), torch.cat([ref, bias[:, None]], 1))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_q4_codes_fuse_with_gguf_blocks_as_the_q4_blocks_they_are(qtype: T) -> None:
    """q, k in Q4_0 (or Q4_1) beside v in Q5_1 (a Q3_K_M or Q5_K_M file): Q4_0/Q4_1 alone load as INT4 codes (the
    default model's path), and fused with GGUF blocks they become segments of their own type, with the same
    weights, instead of a float copy."""
    from pagoda.quantization.gguf_native import native_weight

    k = 256
    a, b = random_blocks(qtype, 64, k, seed=6), random_blocks(T.Q5_1, 32, k, seed=7)
    int4 = native_weight(a, int(qtype), k)
    assert int4.format == "int4"
    fused = PackedWeight.cat([int4, native_weight(b, int(T.Q5_1), k)])
    assert [t for t, _, _ in gguf_blocks.segments(fused.scales)] == [int(qtype), int(T.Q5_1)]
    assert fused.data[:a.nbytes].numpy().tobytes() == a.tobytes()  # the file's very blocks
    ref = torch.cat([reference(a, qtype), reference(b, T.Q5_1)])
    torch.testing.assert_close(fused.dequantize(), ref, rtol=0, atol=0)
    x = torch.randn(3, k)
    assert_sums_of(quant_linear(x, kernel_layout(fused, torch.float32), None), x, ref, 1e-5)


def test_q8_0_codes_fuse_with_gguf_blocks_as_the_q8_0_blocks_they_are() -> None:
    """v in Q8_0 beside q, k in Q5_0 (a Q4_K_M file whose widths the K-quants cannot take): Q8_0 alone loads as INT8
    codes, and fused with GGUF blocks it becomes one more segment, with the same weights."""
    from pagoda.quantization.gguf_native import packed_from_blocks

    k = 64
    a, b = random_blocks(T.Q5_0, 64, k, seed=4), random_blocks(T.Q8_0, 32, k, seed=5)
    int8 = packed_from_blocks(b, int(T.Q8_0), k)
    assert int8.format == "int8"
    fused = PackedWeight.cat([stored_weight(a, int(T.Q5_0), k), int8])
    assert [t for t, _, _ in gguf_blocks.segments(fused.scales)] == [int(T.Q5_0), int(T.Q8_0)]
    ref = torch.cat([reference(a, T.Q5_0), reference(b, T.Q8_0)])
    torch.testing.assert_close(fused.dequantize(), ref, rtol=0, atol=0)
    x = torch.randn(3, k)
    assert_sums_of(quant_linear(x, kernel_layout(fused, torch.float32), None), x, ref, 1e-5)


def shift_q4_k_sub_block_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes Q4_K's split put each sub-block's scale one place off."""
    right = gguf_blocks.GGUF_BLOCKS[int(T.Q4_K)]

    def shifted(b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        codes, (d, dmin, sc, m) = right.split(b)
        return codes, [d, dmin, np.roll(sc, 1, axis=-1), m]

    monkeypatch.setitem(gguf_blocks.GGUF_BLOCKS, int(T.Q4_K),
                        gguf_blocks.GgufBlock(right.block, right.group, right.high_bits, shifted))


def test_a_wrong_sub_block_scale_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above fail for a split whose sub-block scales are off by one place."""
    shift_q4_k_sub_block_scales(monkeypatch)
    raw = random_blocks(T.Q4_K, 32, 256)
    pw = prepared(raw, T.Q4_K, 256)
    assert not torch.equal(pw.dequantize(), reference(raw, T.Q4_K))
    x = torch.randn(1, 256)
    with pytest.raises(AssertionError):
        assert_sums_of(quant_linear(x, pw, None), x, reference(raw, T.Q4_K), 1e-5)


# ---- bf16 activations on AMX tiles (cpu/amx_blocks.h) ----------------------------------------------------
def _gguf_amx() -> bool:
    from pagoda.kernels.cpu_extension import kernel_available

    return kernel_available() and torch.ops.pagoda.gguf_amx_available()


needs_amx = pytest.mark.skipif(not _gguf_amx(), reason="the CPU (or this build) has no AMX-BF16")


def on_tiles(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None, amx: bool = True) -> torch.Tensor:
    """The GGUF kernel with bf16 x on AMX tiles (amx) or through vdpbf16ps (not amx), whatever the default."""
    return torch.ops.pagoda.gguf_vpanel_linear(x, pw.data, pw.scales, bias, amx)


@needs_amx
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_amx_tiles_compute_gguf_py_weights_times_x_with_one_order_at_every_row_count(qtype: T) -> None:
    """On AMX tiles: gguf-py's weights times x (plus the bias) rounded once, and a row's bits the same alone, in a
    strip of fewer than 16 rows (tiles of that many rows), a whole strip, and batches padded to whole strips."""
    n, k = 96, 512 if qtype not in BLOCKS_OF_32 else 96
    raw = random_blocks(qtype, n, k, seed=4)
    ref = reference(raw, qtype)
    pw = prepared(raw, qtype, k, torch.bfloat16)
    bias = torch.randn(n)
    x = torch.randn(max(ROWS), k).bfloat16()
    full = on_tiles(x, pw, bias)
    assert on_tiles(x[:0], pw, bias).shape == (0, n)
    for m in (*ROWS, 16, 33):
        got = on_tiles(x[:m], pw, bias)
        assert torch.equal(got, full[:m])  # batch invariance
        assert_bf16_of(got, torch.cat([x[:m].float(), torch.ones(m, 1)], 1), torch.cat([ref, bias[:, None]], 1))
        assert torch.equal(on_tiles(x[m - 1:m], pw, bias), full[m - 1:m])  # the last row alone


@needs_amx
def test_amx_tiles_run_bf16_gguf_weights_wherever_the_cpu_has_them() -> None:
    """kernel_layout gives bf16 GGUF weights the AMX tiles, which quant_linear (and the decoder stack's format code)
    then take at every row count; TDPBF16PS adds a group's products otherwise than a vdpbf16ps chain, so over every
    type some outputs' low bits tell the two drivers apart (which makes the equalities pin the path). The vdpbf16ps
    driver, still every AVX512-BF16 CPU's without AMX, stays exact here too; fp32 activations never take the tiles."""
    k, differ = 512, 0
    torch.manual_seed(0)
    for i, qtype in enumerate(TYPES):
        raw = random_blocks(qtype, 64, k, seed=20 + i)
        pw = prepared(raw, qtype, k, torch.bfloat16)
        assert pw.amx and pw.code == LINEAR_FORMATS["ggufa"]
        assert not prepared(raw, qtype, k).amx
        x = torch.randn(256, k).bfloat16()
        tiles, chains = on_tiles(x, pw), on_tiles(x, pw, amx=False)
        differ += int((tiles != chains).sum())
        for m in ROWS:
            assert torch.equal(quant_linear(x[:m], pw, None), tiles[:m])
            assert torch.equal(quant_linear(x[:m], dataclasses.replace(pw, gguf_driver="float"), None), chains[:m])
        assert_bf16_of(chains[:64], x[:64].float(), reference(raw, qtype))
    assert differ > 0


@needs_amx
def test_amx_tiles_catch_a_wrong_sub_block_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 check passes on the tiles for the right split and fails for scales one place off."""
    raw = random_blocks(T.Q4_K, 32, 256, seed=5)
    x = torch.randn(3, 256).bfloat16()
    assert_bf16_of(on_tiles(x, prepared(raw, T.Q4_K, 256, torch.bfloat16)), x.float(), reference(raw, T.Q4_K))
    shift_q4_k_sub_block_scales(monkeypatch)
    with pytest.raises(AssertionError):
        assert_bf16_of(on_tiles(x, prepared(raw, T.Q4_K, 256, torch.bfloat16)), x.float(), reference(raw, T.Q4_K))


def test_amx_tiles_take_bf16_x_on_a_cpu_with_amx_only() -> None:
    """fp32 x stays on the fp32 driver: asking for tiles is an error, as it is on a CPU or build without AMX."""
    from pagoda.kernels.cpu_extension import kernel_available

    if not kernel_available():
        pytest.skip("no C++ kernels")
    raw = random_blocks(T.Q4_K, 32, 256)
    pw = prepared(raw, T.Q4_K, 256, torch.bfloat16)
    with pytest.raises(RuntimeError, match="AMX"):
        on_tiles(torch.randn(2, 256), pw)
    if not _gguf_amx():
        with pytest.raises(RuntimeError, match="AMX"):
            on_tiles(torch.randn(2, 256).bfloat16(), pw)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_panels_hold_the_files_bytes(qtype: T) -> None:
    """Resident bytes: the panels regroup the blocks (Q4_K/Q5_K spend a byte on each 6-bit scale and min)."""
    raw = random_blocks(qtype, 64, 512)
    assert prepared(raw, qtype, 512).data.numel() <= 1.03 * raw.nbytes


# ---- a tiny Llama GGUF of K-quant tensors ------------------------------------------------------------------
CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5)
PROMPTS = [[5, 17, 99, 3, 250], list(range(10, 47)), [7], list(range(100, 300, 3))]


# ---- int8 activations (quant_activations="int8": cpu/gguf_a8_linear.cpp) ----------------------------------
Q8_K_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS}  # ggml-cpu's vec_dot_type Q8_K; the rest Q8_0


def round_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's quantize_row_q8_K rounds it: per 256 values, the first value of largest magnitude maps to
    -127, the rest to nearest integers (ties to even, capped at 127), times 1 / the block's scale."""
    b = x.reshape(-1, 256)
    top = b.gather(1, b.abs().argmax(dim=1, keepdim=True))
    # Tensor over tensor: torch takes a scalar over a tensor as the reciprocal times the scalar, two roundings.
    iscale = torch.where(top != 0, torch.full_like(top, -127.0) / top, torch.zeros_like(top))
    q = torch.clamp(torch.round(iscale * b), max=127)
    return (q * torch.where(top != 0, torch.ones_like(top) / iscale, torch.zeros_like(top))).reshape(x.shape)


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x as ggml-cpu's x86 quantize_row_q8_0 rounds it: per 32 values, codes round(x * 127 / amax) times amax / 127
    stored as fp16."""
    b = x.reshape(-1, 32)
    amax = b.abs().amax(dim=1, keepdim=True)
    q = torch.round(b * torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
    return (q * (amax / 127).half().float()).reshape(x.shape)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with an outlier per block now and then, and a zero block (its scale 0), as hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[torch.rand(m, k, generator=g) < 0.01] *= 30
    x[0, :256] = 0
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_activations_round_x_as_llama_cpp_and_dot_the_codes_exactly(qtype: T) -> None:
    """x rounded per block as llama.cpp rounds it for this type (Q8_K or Q8_0), times gguf-py's weights, plus the
    bias, in fp32 sums of exact integer dot products: a row's bits the same at every row count, and the build's
    micro-kernel (VNNI, AVX2) giving the reference micro-kernel's very integers."""
    n, k = 96, 512
    raw = random_blocks(qtype, n, k, seed=30)
    ref = reference(raw, qtype)
    pw = kernel_layout(stored_weight(raw, int(qtype), k), torch.float32, "int8")
    assert (pw.layout, pw.gguf_driver, pw.code) == ("vpanels", "int8", LINEAR_FORMATS["ggufi8"])
    assert kernel_layout(stored_weight(raw, int(qtype), k), torch.float32).gguf_driver == "float"
    x, bias = activations(max(ROWS), k, seed=31), torch.randn(n)
    xr = (round_q8_k if qtype in Q8_K_TYPES else round_q8_0)(x)
    assert torch.equal(torch.ops.pagoda.gguf_a8_round(x, int(qtype)), xr)
    full = quant_linear(x, pw, bias)
    assert torch.equal(full, torch.ops.pagoda.gguf_a8_linear(x, pw.data, pw.scales, bias, True))
    ones = torch.ones(max(ROWS), 1)
    assert_sums_of(full, torch.cat([xr, ones], 1), torch.cat([ref, bias[:, None]], 1), 1e-5)
    for m in ROWS:
        assert torch.equal(quant_linear(x[:m], pw, bias), full[:m])
        assert torch.equal(quant_linear(x[m - 1:m], pw, bias), full[m - 1:m])
    xb = x.bfloat16()
    got = quant_linear(xb, pw, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, quant_linear(xb.float(), pw, bias).bfloat16())  # bf16 x rounds as its fp32 value


def test_int8_activations_round_each_segment_for_its_type() -> None:
    """A fused weight of Q4_K (Q8_K activations) beside Q8_0 and Q5_0 (Q8_0 activations): each segment's columns
    are its own type's product."""
    k = 256
    parts = [(T.Q4_K, 64), (T.Q8_0, 32), (T.Q5_0, 32)]
    raws = [random_blocks(t, n, k, seed=40 + i) for i, (t, n) in enumerate(parts)]
    pw = kernel_layout(PackedWeight.cat([stored_weight(r, int(t), k) for r, (t, _) in zip(raws, parts)]),
                       torch.float32, "int8")
    assert pw.gguf_driver == "int8"
    x = activations(5, k, seed=41)
    got = quant_linear(x, pw, None)
    want = torch.cat([(round_q8_k if t in Q8_K_TYPES else round_q8_0)(x).double() @ reference(r, t).double().T
                      for r, (t, _) in zip(raws, parts)], 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_int8_activations_take_q8_0_codes_as_their_blocks() -> None:
    """INT8 codes that are exactly Q8_0 blocks (a GGUF's lone matrices, its tied head's table) run as llama.cpp runs
    those blocks, with Q8_0 activations; INT4 keeps its own int8-activation layout."""
    k = 128
    raw = random_blocks(T.Q8_0, 32, k, seed=50)
    codes = packed_from_blocks(raw, int(T.Q8_0), k)
    assert codes.format == "int8"
    pw = kernel_layout(codes, torch.float32, "int8")
    assert (pw.format, pw.gguf_driver) == ("gguf", "int8")
    x = activations(3, k, seed=51)
    want = round_q8_0(x).double() @ reference(raw, T.Q8_0).double().T
    torch.testing.assert_close(quant_linear(x, pw, None).double(), want, rtol=1e-4, atol=1e-4)
    q4 = kernel_layout(packed_from_blocks(random_blocks(T.Q4_1, 32, k), int(T.Q4_1), k), torch.float32, "int8")
    assert q4.format == "int4" and q4.gguf_driver == "float"


def test_int8_activations_catch_a_wrong_sub_block_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = random_blocks(T.Q4_K, 32, 256, seed=3)
    x = activations(2, 256, seed=4)
    ok = quant_linear(x, kernel_layout(stored_weight(raw, int(T.Q4_K), 256), torch.float32, "int8"), None)
    shift_q4_k_sub_block_scales(monkeypatch)
    bad = quant_linear(x, kernel_layout(stored_weight(raw, int(T.Q4_K), 256), torch.float32, "int8"), None)
    assert not torch.allclose(ok, bad, rtol=1e-3, atol=1e-3)


def _write_kquant_llama(path: Path) -> Path:
    """Q4_K for most matrices, Q6_K for v, down and the head (as Q4_K_M mixes them), F32 norms."""
    import gguf
    from tiny_models import add_gguf_hparams, finish_gguf

    h, f, v, kv = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], 128
    w = gguf.GGUFWriter(str(path), "llama")
    add_gguf_hparams(w, CFG)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(v)
    seed = iter(range(100))

    def blocks(name: str, qtype: T, rows: int, cols: int) -> None:
        scale = 4e-5 if qtype == T.Q6_K else 1.5e-3
        raw = random_blocks(qtype, rows, cols, seed=next(seed), scale=scale)
        w.add_tensor(name, raw, raw_dtype=qtype)

    rng = np.random.default_rng(7)
    blocks("token_embd.weight", T.Q4_K, v, h)
    blocks("output.weight", T.Q6_K, v, h)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    for i in range(CFG["num_hidden_layers"]):
        for name, qtype, rows, cols in [("attn_q", T.Q4_K, h, h), ("attn_k", T.Q4_K, kv, h), ("attn_v", T.Q6_K, kv, h),
                                        ("attn_output", T.Q4_K, h, h), ("ffn_gate", T.Q4_K, f, h),
                                        ("ffn_up", T.Q4_K, f, h), ("ffn_down", T.Q6_K, h, f)]:
            blocks(f"blk.{i}.{name}.weight", qtype, rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    finish_gguf(w)
    return path


def test_a_kquant_gguf_runs_as_stored_and_generates_what_its_float_copy_does(tmp_path, default_gguf) -> None:
    from pagoda import LLM, SamplingParams

    path = str(_write_kquant_llama(tmp_path / "tiny-kquants.gguf"))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    stored = LLM(path, tokenizer=default_gguf, quantization="gguf", dtype="float32", kv_cache_memory="16MiB")
    model = stored.engine.runner.model
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   model.lm_head):
        assert (linear.qweight.format, linear.qweight.layout) == ("gguf", "vpanels")
    types = {t for t, _, _ in gguf_blocks.segments(layer.self_attn.qkv_proj.qweight.scales)}
    assert types == {int(T.Q4_K), int(T.Q6_K)}  # q, k in Q4_K beside v in Q6_K, one fused weight
    assert model.embed_tokens.pw.format == "gguf"
    held = weight_bytes_by_format(model)  # what `pagoda bench quant` prints
    assert held["Q4_K"] > 0 and held["Q6_K"] > 0 and "float32" in held  # the norms
    assert sum(held.values()) <= 1.05 * Path(path).stat().st_size
    got = greedy(stored)
    del stored
    want = greedy(LLM(path, tokenizer=default_gguf, dtype="float32", kv_cache_memory="16MiB"))  # dequantized
    assert got == want


def test_a_kquant_gguf_runs_with_int8_activations_as_llama_cpp_rounds_them(tmp_path, default_gguf,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """quant_activations="int8": every GGUF linear takes the int8-activation driver (the decoder stack's format code
    too: the same tokens and logprobs as layer by layer), and the model scores a prompt as the exact path does on
    inputs rounded in torch as llama.cpp rounds them, per segment type."""
    from pagoda import LLM, SamplingParams
    from pagoda.kernels import linear_kernel
    from pagoda.kernels.cpu_extension import build_isa

    path = str(_write_kquant_llama(tmp_path / "tiny-kquants.gguf"))
    kw = dict(tokenizer=default_gguf, quantization="gguf", dtype="float32", kv_cache_memory="16MiB")
    llm = LLM(path, quant_activations="int8", **kw)
    model = llm.engine.runner.model
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   model.lm_head):
        assert linear.qweight.gguf_driver == "int8"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(engine: LLM) -> list:
        outs = engine.generate(PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    if build_isa().avx512:
        fused = run(llm)
        assert model.stack is not None
        model.stack = None
        assert run(llm) == fused

    scored, long = SamplingParams(max_tokens=1, prompt_logprobs=0), [p for p in PROMPTS if len(p) > 1]

    def prompt_logprobs(engine: LLM) -> torch.Tensor:
        outs = engine.generate(long, scored, use_tqdm=False)
        return torch.tensor([d[t].logprob for o in outs for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])

    got = prompt_logprobs(llm)
    del llm
    k_types = {int(t) for t in Q8_K_TYPES}
    exact_linear = linear_kernel.quant_linear

    def rounded(x, pw, bias=None, use_cpp=False):  # each segment's columns from x rounded for its type
        cols, r0 = [], 0
        for t, rows, _ in gguf_blocks.segments(pw.scales):
            xr = (round_q8_k if t in k_types else round_q8_0)(x.float())
            cols.append(exact_linear(xr, pw=pw, bias=bias, use_cpp=use_cpp)[..., r0:r0 + rows])
            r0 += rows
        return torch.cat(cols, -1)

    monkeypatch.setattr(linear_kernel, "quant_linear", rounded)
    monkeypatch.setattr(linear_kernel.LinearKernel, "stack_args", lambda self: None)  # layer by layer, through it
    torch.testing.assert_close(got, prompt_logprobs(LLM(path, **kw)), rtol=0, atol=1e-4)


def test_tensor_parallel_splits_whole_super_blocks() -> None:
    from pagoda.distributed.tensor_parallel import _take_columns

    k = 512
    raw = random_blocks(T.Q6_K, 32, k)
    part = _take_columns(stored_weight(raw, int(T.Q6_K), k), range(256, 512), "down_proj")
    assert (part.format, part.in_features) == ("gguf", 256)
    torch.testing.assert_close(part.dequantize(), reference(raw, T.Q6_K)[:, 256:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="split a GGUF block"):
        _take_columns(stored_weight(raw, int(T.Q6_K), k), range(128, 384), "down_proj")
