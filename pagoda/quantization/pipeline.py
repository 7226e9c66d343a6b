"""`pagoda quantize`: load a model in fp32, quantize its decoder linears to INT4, write the checkpoint."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.quantization import CALIBRATION_METHODS
from pagoda.quantization.awq import awq_layer_quantizer, rtn_with_clip
from pagoda.quantization.calibration import (
    decoder_layers,
    load_calibration_ids,
    load_hf_float_model,
    quantize_sequentially,
)
from pagoda.quantization.checkpoint import write_checkpoint
from pagoda.quantization.gptq import gptq_layer_quantizer
from pagoda.quantization.int4_format import Int4Weight

METHODS = CALIBRATION_METHODS


@dataclass
class QuantizeOptions:
    method: str = "awq"
    group_size: int = 128
    act_order: bool = False
    num_samples: int = 64
    seq_len: int = 512
    awq_clip: bool = True
    awq_gptq: bool = False  # AWQ: also try GPTQ rounding of the scaled weights (lower output error wins)
    percdamp: float = 0.01
    dtype: torch.dtype = torch.float32  # of the tensors stored as floats (embeddings, norms)


def quantize_hf_model(model: nn.Module, opts: QuantizeOptions, calib_ids: torch.Tensor | None,
                      log: Callable[[str], None] | None = None) -> dict[str, Int4Weight]:
    """Quantize the decoder linears of an fp32 HF model in place (they end up holding their
    dequantized weights; AWQ also folds its scales into norms/linears); returns {HF prefix: Int4Weight}."""
    if opts.method == "rtn":
        out = {}
        for i, layer in enumerate(decoder_layers(model)):
            for name, mod in layer.named_modules():
                if isinstance(mod, nn.Linear):
                    q = rtn_with_clip(mod.weight.data, opts.group_size)
                    mod.weight.data.copy_(q.dequantize())
                    out[f"model.layers.{i}.{name}"] = q
        return out
    if calib_ids is None:
        raise ValueError(f"--method {opts.method} needs calibration text (--calib FILE)")
    if opts.method == "gptq":
        quantizer = gptq_layer_quantizer(opts.group_size, opts.act_order, opts.percdamp)
    elif opts.method == "awq":
        quantizer = awq_layer_quantizer(opts.group_size, clip=opts.awq_clip, gptq=opts.awq_gptq,
                                        act_order=opts.act_order)
    else:
        raise ValueError(f"unknown method {opts.method!r}; expected one of {METHODS}")
    return quantize_sequentially(model, calib_ids, quantizer, log=log)


def quantize_model(model_path: str | None, out_dir: str, opts: QuantizeOptions, calib_path: str | None = None,
                   log: Callable[[str], None] | None = None) -> dict[str, float]:
    """The whole command: returns timings."""
    t0 = time.perf_counter()
    model, hf_config = load_hf_float_model(model_path)
    ids = None
    if opts.method != "rtn":
        if not calib_path:
            raise ValueError(f"--method {opts.method} needs --calib FILE")
        ids = load_calibration_ids(model_path, calib_path, opts.num_samples, opts.seq_len)
        if log:
            log(f"calibration: {ids.shape[0]} windows x {ids.shape[1]} tokens")
    t1 = time.perf_counter()
    with torch.no_grad():
        qweights = quantize_hf_model(model, opts, ids, log)
    t2 = time.perf_counter()
    write_checkpoint(out_dir, model_path, hf_config, model.state_dict(), qweights, opts.method, opts.group_size,
                     opts.act_order and opts.method == "gptq", opts.dtype)
    return {"load_s": t1 - t0, "quantize_s": t2 - t1, "write_s": time.perf_counter() - t2}
