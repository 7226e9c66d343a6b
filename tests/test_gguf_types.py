"""Every GGUF tensor type Pagoda runs as stored (quantization/gguf_native.py BLOCK_TYPES): random blocks (every
code, random sub-block scales, finite fp16 fields) decode to exactly gguf-py's dequantized weights, as codes and in
the form the loader gives it (native_weight: its blocks' bits, format "gguf", for the types kept so), and the
quantized linear on them equals those weights times x at every row count, with a row's bits whatever the batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize

from pagoda.kernels.cpu_extension import kernel_available
from pagoda.kernels.quant_linear import PackedWeight, kernel_layout, quant_linear
from pagoda.quantization.gguf_native import BLOCK_TYPES, keeps_blocks, native_weight, packed_from_blocks

# Byte offsets of each type's fp16 fields (d, dmin, m): random bytes there could be inf or NaN.
FP16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
               T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}


def random_blocks(qtype: T, rows: int, k: int, seed: int = 0) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        d = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    if qtype == T.MXFP4:
        raw[..., 0] = rng.integers(118, 130, size=raw.shape[:2])  # exponents around 2^0
    return raw.reshape(rows, -1)


TYPES = [T(q) for q in BLOCK_TYPES]
# Kept in their blocks' bits wherever the C++ kernels are built: fails if one falls back to codes.
AS_BLOCKS = {T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4}


def loaded(raw: np.ndarray, qtype: T, k: int) -> PackedWeight:
    """The weight as gguf_native_weights loads it (native_weight): its blocks where keeps_blocks(), else codes."""
    kept = keeps_blocks(int(qtype), raw.shape[0])
    assert kept == (qtype in AS_BLOCKS and kernel_available())
    pw = native_weight(raw, int(qtype), k)
    assert (pw.format == "gguf") == kept
    return pw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_decode_to_gguf_py_values_and_the_kernel_computes_on_them(qtype: T) -> None:
    n, k = 64, 512
    raw = random_blocks(qtype, n, k)
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(n, k)
    codes = packed_from_blocks(raw, int(qtype), k)
    torch.testing.assert_close(codes.dequantize(), ref, rtol=0, atol=0)
    x = torch.randn(64, k, dtype=torch.float64)
    want = (x @ ref.double().T)
    for pw in (codes, loaded(raw, qtype, k)):  # as codes (no kernels, rows not whole panels), and as loaded
        prepared = kernel_layout(pw, torch.float32)
        torch.testing.assert_close(prepared.dequantize(), ref, rtol=0, atol=0)  # what the kernel decodes
        for m in (1, 3, 17, 64):  # every row count, the same numerics (float32 sums against a float64 reference)
            got = quant_linear(x[:m].float(), prepared, None).double()
            torch.testing.assert_close(got, want[:m], rtol=1e-4, atol=1e-4 * want.abs().max().item())
        one, batch = quant_linear(x[:1].float(), prepared, None), quant_linear(x[:17].float(), prepared, None)
        assert torch.equal(one, batch[:1])


def test_a_wrong_sub_block_scale_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactness check above fails for a decoder whose sub-block scales are off by one place."""
    from pagoda.quantization import gguf_native

    right = BLOCK_TYPES[int(T.Q4_K)]

    def shifted(b: np.ndarray):  # noqa: ANN202
        codes, scales, offsets = right.decode(b)
        return codes, np.roll(scales, 1, axis=-1), offsets

    monkeypatch.setitem(gguf_native.BLOCK_TYPES, int(T.Q4_K), gguf_native.BlockType("int4", 32, shifted))
    raw = random_blocks(T.Q4_K, 16, 256)
    ref = torch.from_numpy(dequantize(raw, T.Q4_K).astype(np.float32))
    assert not torch.equal(packed_from_blocks(raw, int(T.Q4_K), 256).dequantize(), ref)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.Q5_1, T.IQ4_NL, T.IQ4_XS, T.MXFP4],
                         ids=lambda t: t.name)
def test_bf16_activations_run_the_same_weights(qtype: T) -> None:
    n, k = 32, 256
    raw = random_blocks(qtype, n, k, seed=1)
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(n, k)
    prepared = kernel_layout(loaded(raw, qtype, k), torch.bfloat16)
    x = torch.randn(9, k).bfloat16()
    want = x.double() @ ref.double().T
    full = quant_linear(x, prepared, None)
    torch.testing.assert_close(full.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    for m in (1, 2, 3):  # the bf16 driver's tiles of one, two and more rows: a row's bits whatever the batch
        assert torch.equal(quant_linear(x[:m], prepared, None), full[:m])
