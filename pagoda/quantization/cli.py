"""`pagoda quantize MODEL --method gptq|awq|rtn --calib FILE --out DIR`: write an INT4 checkpoint;
`pagoda quantize MODEL --gguf TYPE --out FILE.gguf`: write a GGUF."""
from __future__ import annotations

import argparse
import sys

from pagoda.quantization import CALIBRATION_METHODS
from pagoda.quantization.gguf_export import GGUF_PY_TYPES
from pagoda.quantization.llama_quantizer import PRESETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", choices=CALIBRATION_METHODS, default="awq")
    p.add_argument("--calib", default=None, help="calibration text file (needed by gptq and awq)")
    p.add_argument("--out", required=True, help="output folder (created); with --gguf, the .gguf file")
    p.add_argument("--gguf", default=None, metavar="TYPE", choices=list(dict.fromkeys(GGUF_PY_TYPES + PRESETS)),
                   help=f"write a GGUF instead of an INT4 checkpoint: {', '.join(GGUF_PY_TYPES)} by gguf-py; "
                        f"{', '.join(p for p in PRESETS if p not in GGUF_PY_TYPES)} by llama.cpp's quantizer "
                        "(bash scripts/install-peers.sh llama)")
    p.add_argument("--llama-python", default=None,
                   help="with --gguf: a python that imports llama_cpp (default: this one if it does, else the "
                        "peer venv's)")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                   help="INT4 group size (linears whose input size it does not divide use the next smaller)")
    p.add_argument("--act-order", action="store_true",
                   help="GPTQ (and AWQ's --awq-gptq): quantize columns by descending Hessian diagonal")
    p.add_argument("--num-samples", type=int, default=64, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--no-awq-clip", action="store_true", help="AWQ: skip the weight-clipping search")
    p.add_argument("--awq-gptq", action="store_true",
                   help="AWQ: also round each scaled linear with GPTQ and keep the lower output error")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the tensors stored unquantized (embeddings, norms)")


def main(args: argparse.Namespace) -> int:
    if args.gguf is not None:
        from pagoda.quantization.gguf_export import export_gguf

        try:
            summary = export_gguf(args.model, args.out, args.gguf, args.llama_python)
        except (RuntimeError, ValueError) as e:  # a missing quantizer (QuantizerUnavailable), a refused model
            print(f"pagoda quantize: {e}", file=sys.stderr)
            return 2
        print(summary.line())
        return 0
    import torch

    from pagoda.quantization.pipeline import QuantizeOptions, quantize_model

    opts = QuantizeOptions(method=args.method, group_size=args.group_size, act_order=args.act_order,
                           num_samples=args.num_samples, seq_len=args.seq_len, awq_clip=not args.no_awq_clip,
                           awq_gptq=args.awq_gptq,
                           dtype=getattr(torch, args.dtype))
    times = quantize_model(args.model, args.out, opts, args.calib,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"wrote {args.out} ({args.method}, group {args.group_size}) in "
          f"{sum(times.values()):.1f} s (quantize {times['quantize_s']:.1f} s)")
    return 0
