"""Time quantized-linear candidates per shape and M: `python -m benchmarks.quant_kernels [--m 1,8,32]`.

Rows: float baselines (F.linear fp32 / bf16; oneDNN prepacked; Pagoda's panel-packed kernel, which the
dense Linear runs), Pagoda's C++ streaming kernel per format
(cpu/quant_linear.cpp), torch's packed ops (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu with
bf16 activations) and dequantize-then-F.linear in bf16. Prints microseconds per call.

`--gguf Q4_K,Q5_K,Q6_K,Q5_0,Q8_0` times GGUF blocks instead, per type whose block divides K: held as stored (format
"gguf", the kernel the engine runs) against the same weights as INT4/INT8 codes in panels (the path these types took
before they kept their blocks), with `--act-dtype` activations; with bf16 ones on a CPU with AMX, the blocks on AMX
tiles too ("gguf amx", cpu/amx_blocks.h).

`--model-sweep float32|bfloat16|int4|fp8` times the dense (or quantized) kernels the way a step meets them
instead: every one of SmolLM2's 30 layers with its own weights (cold in cache) plus the LM
head, one call each, rounds alternating between the kernels, best of `--rounds`; milliseconds per step. The
quantized sweeps run every layout the loaded build has (row-major, the portable panels, the AVX512-BF16 panels)
and, with `--act-dtype float32`, oneDNN's fp32 GEMM on the dequantized weights beside them; `--kernels avx2`
loads that build (with `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`: what an AVX2 CPU runs).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.kernels.cpu_extension import BUILDS, kernel_available, load
from pagoda.kernels.linear import SMALL_M, linear, onednn_linear, panel_pack, prepack, small_m_supported
from pagoda.kernels.quant_linear import PackedWeight, dequant_linear, kernel_layout, quant_linear, vpanel_width
from pagoda.quantization.methods import quantize_weight

# SmolLM2-135M's layers: fused qkv, o_proj, fused gate|up, down_proj, lm_head (tied embedding).
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def _time(fn: Callable[[], object], min_s: float = 0.2) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def candidates(k: int, n: int, m: int) -> dict[str, Callable[[], object]]:
    w = torch.randn(n, k) / k**0.5
    x = torch.randn(m, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    p32, p16 = prepack(w), prepack(wb)
    p4, p8, pf = quantize_weight("int4", w, 128), quantize_weight("int8", w), quantize_weight("fp8", w)
    out: dict[str, Callable[[], object]] = {
        "fp32 F.linear": lambda: F.linear(x, w),
        "bf16 F.linear": lambda: F.linear(xb, wb),
        # oneDNN on a weight packed at load: the dense Linear's path above SMALL_M rows where panels can't run.
        "fp32 prepacked": lambda: linear(x, w, None, small_m_ok=False, packed=p32),
        "bf16 prepacked": lambda: linear(xb, wb, None, small_m_ok=False, packed=p16),
        # The streaming kernel (at every M, as the layers run it).
        "int4 pagoda": lambda: quant_linear(xb, p4, None, use_cpp=True),
        "int8 pagoda": lambda: quant_linear(xb, p8, None, use_cpp=True),
        "fp8 pagoda": lambda: quant_linear(xb, pf, None, use_cpp=True),
        "int4 dequant(C++)+bf16": lambda: dequant_linear(xb, p4, None, use_cpp=True),
    }
    for name, xx, ww in (("fp32 panels", x, w), ("bf16 panels", xb, wb)):  # the dense Linear's kernel
        panels = panel_pack(ww)
        if panels is not None:
            out[name] = lambda xx=xx, ww=ww, panels=panels: linear(xx, ww, None, small_m_ok=False, panels=panels)
    if n % 16 == 0 and torch.ops.pagoda.quant_panels_supported(k, p4.group_size):  # bf16 INT4/INT8 layers
        p4p, p8p, pfp = p4.panels16(), p8.panels16(), pf.panels16()
        out["int4 panels"] = lambda: quant_linear(xb, p4p, None, use_cpp=True)
        out["int8 panels"] = lambda: quant_linear(xb, p8p, None, use_cpp=True)
        out["fp8 panels"] = lambda: quant_linear(xb, pfp, None, use_cpp=True)
    if n % 8 == 0 and torch.ops.pagoda.int4x8_supported(k, p4.group_size):  # quant_activations="int8"
        p4x8 = p4.interleave8()
        out["int4x8 int8-act"] = lambda: quant_linear(xb, p4x8, None, use_cpp=True)
    q8 = p8.data
    s8 = p8.scales.view(-1).bfloat16()
    out["int8 aten int8pack"] = lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8)
    g = p4.group_size
    codes = p4.codes().to(torch.int32)
    # aten's rule: w = (q - 8) * scale + zero  ->  zero = offset + 8 * scale.
    sz = torch.stack((p4.scales, p4.offsets + 8 * p4.scales), dim=-1).transpose(0, 1).contiguous().bfloat16()
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        out["int4 aten int4pack"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, g, sz)
    except RuntimeError:
        pass
    return out


def _random_blocks(qtype: int, n: int, k: int) -> np.ndarray:
    """Valid GGUF blocks uint8 [n, bytes]: gguf-py's quantizer where it has one, else random bytes (every code and
    sub-block scale) with small finite fp16 fields."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    try:
        return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02, T(qtype))
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[T(qtype)]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[T(qtype)]:  # d, dmin: fp16
        d = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def gguf_candidates(k: int, n: int, m: int, types: list[str], act: torch.dtype) -> dict[str, Callable[[], object]]:
    """Per GGUF type whose block divides K: its blocks as stored against its weights as codes."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as T

    from pagoda.quantization.gguf_native import packed_from_blocks, stored_weight

    x = torch.randn(m, k).to(act)
    out: dict[str, Callable[[], object]] = {}
    for name in types:
        qtype = int(T[name])
        if k % GGML_QUANT_SIZES[T(qtype)][0]:
            continue
        raw = _random_blocks(qtype, n, k)
        for path, pw in (("gguf", stored_weight(raw, qtype, k)), ("codes", packed_from_blocks(raw, qtype, k))):
            pw = kernel_layout(pw, act)
            out[f"{name} {path}"] = lambda pw=pw: quant_linear(x, pw, None, use_cpp=True)
            if path == "gguf" and act == torch.bfloat16 and torch.ops.pagoda.gguf_amx_available():
                out[f"{name} gguf amx"] = lambda pw=pw: torch.ops.pagoda.gguf_vpanel_linear(x, pw.data, pw.scales,
                                                                                           None, True)
    return out


NUM_LAYERS = 30


LayerCall = Callable[[torch.Tensor, int], object]  # (x, index of the weight)


def _dense_kernels(dtype: torch.dtype, ws: list[torch.Tensor], m: int) -> dict[str, LayerCall]:
    """At m rows: what the dense Linear ran before panels (streaming kernel or oneDNN), first; then panels."""
    panels = [panel_pack(w) for w in ws]
    streaming = m <= SMALL_M and all(small_m_supported(dtype, w.shape[1]) for w in ws)
    prev = "streaming" if streaming else "oneDNN prepacked"
    packed = [prepack(w) for w in ws] if prev == "oneDNN prepacked" else [None] * len(ws)
    out: dict[str, LayerCall] = {
        prev: lambda x, i: linear(x, ws[i], None, small_m_ok=prev == "streaming", packed=packed[i])}
    if all(p is not None for p in panels):
        out["panels"] = lambda x, i: linear(x, ws[i], None, small_m_ok=False, panels=panels[i])
    return out


def _quant_kernels(ws: list[PackedWeight], dtype: torch.dtype = torch.bfloat16) -> dict[str, LayerCall]:
    """Quantized layers and LM head: the row-major streaming kernels first; then each panel layout the build has;
    INT4 with INT8 activations (quant_activations="int8"); with fp32 activations, oneDNN on the dequantized fp32
    weights last (what the float model runs)."""
    out: dict[str, LayerCall] = {"row-major": lambda x, i: quant_linear(x, ws[i], None, use_cpp=True)}
    width = vpanel_width()
    if all(pw.out_features % width == 0 for pw in ws):
        vpanels = [pw.vpanels(width) for pw in ws]
        out["vpanels"] = lambda x, i: quant_linear(x, vpanels[i], None, use_cpp=True)
    if torch.ops.pagoda.quant_panels_supported(ws[0].in_features, ws[0].group_size):
        panels = [pw.panels16() for pw in ws]
        out["panels"] = lambda x, i: quant_linear(x, panels[i], None, use_cpp=True)
    if any(pw.format == "int4" for pw in ws):  # quant_activations="int8": the layouts the engine then takes
        a8 = [kernel_layout(pw, dtype, "int8") for pw in ws]
        out["int8-act"] = lambda x, i: quant_linear(x, a8[i], None, use_cpp=True)
    if dtype == torch.float32:
        dense = [prepack(pw.dequantize()) for pw in ws]
        out["fp32 oneDNN"] = lambda x, i: onednn_linear(x, dense[i], None)
    return out


def model_sweep(kind: str, ms: list[int], rounds: int = 4, act_dtype: str = "bfloat16") -> None:
    """kind: float32 | bfloat16 (dense kernels) | int4 (INT4 g64 layers and an INT8 head, as the INT4 methods
    hold them) | fp8 (FP8 layers and head); the quantized kinds with `act_dtype` activations."""
    shapes = SHAPES[:-1] * NUM_LAYERS + SHAPES[-1:]
    quantized = kind in ("int4", "fp8")
    dtype = getattr(torch, act_dtype) if quantized else getattr(torch, kind)
    ws = [torch.randn(n, k) / k**0.5 for k, n in shapes]
    if kind == "int4":
        ws = [quantize_weight("int4", w, 64) for w in ws[:-1]] + [quantize_weight("int8", ws[-1])]
    elif kind == "fp8":
        ws = [quantize_weight("fp8", w) for w in ws]
    else:
        ws = [w.to(dtype) for w in ws]
    for m in ms:
        xs = {k: torch.randn(m, k).to(dtype) for k, _ in SHAPES}
        kernels = _quant_kernels(ws, dtype) if quantized else _dense_kernels(dtype, ws, m)
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(rounds):
            for name, fn in kernels.items():
                t0 = time.perf_counter()
                for i, (k, _) in enumerate(shapes):
                    fn(xs[k], i)
                best[name] = min(best[name], time.perf_counter() - t0)
        cells = "  ".join(f"{name}={t * 1e3:7.1f} ms" for name, t in best.items())
        before = next(iter(best))
        ratio = "".join(f"  {name} vs {before}: {best[before] / best[name]:.2f}x" for name in best if name != before)
        print(f"{kind} M={m:4d}  {cells}{ratio}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", default="1,4,8,32,128,512")
    ap.add_argument("--shapes", default=None, help="K:N,K:N (default: SmolLM2-135M's)")
    ap.add_argument("--model-sweep", choices=["float32", "bfloat16", "int4", "fp8"], default=None,
                    help="time the dense (or quantized) kernels over a whole model's linears per step (cold weights)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gguf", default=None, help="GGUF types (Q4_K,Q5_K,Q6_K,Q5_0,Q8_0): their blocks as stored "
                    "against their codes, instead of the default candidates")
    ap.add_argument("--act-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="activations of the quantized sweeps")
    ap.add_argument("--kernels", choices=list(BUILDS), default=None, help="the C++ kernel build to load (default: "
                    "the CPU's best)")
    args = ap.parse_args(argv)
    if args.kernels:
        load(args.kernels)
    if not kernel_available():
        raise SystemExit("pagoda's C++ kernels are unavailable on this machine")
    torch.manual_seed(0)
    if args.model_sweep:
        model_sweep(args.model_sweep, [int(v) for v in args.m.split(",")], args.rounds, args.act_dtype)
        return
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    for k, n in shapes:
        for m in (int(v) for v in args.m.split(",")):
            fns = candidates(k, n, m) if args.gguf is None else \
                gguf_candidates(k, n, m, args.gguf.split(","), getattr(torch, args.act_dtype))
            row = {name: _time(fn) for name, fn in fns.items()}
            if not row:
                continue
            best = min(row, key=row.get)
            cells = "  ".join(f"{name}={us:8.1f}" for name, us in row.items())
            print(f"K={k:5d} N={n:6d} M={m:4d}  {cells}  best: {best}", flush=True)


if __name__ == "__main__":
    main()
