"""A quantization method as a transform on a model's weight stream (model/weights.py loads the stream).

- None: weights as stored (GGUF dequantized to float), unless the folder is a saved INT4
  checkpoint (config.json quantization_config), which always loads quantized.
- int8 / int4 / fp8: float weights read in fp32, every decoder Linear's matrix quantized as it streams by,
  the LM head (tied or not) quantized once loaded (methods.lm_head_method).
- int4 on a GGUF keeps the file's grid: Q4_0/Q4_1 matrices load as stored (INT4, groups of 32, exact) and
  a Q8_0 embedding stays the tied head's INT8 table, instead of re-quantizing their dequantized values onto
  coarser groups (which costs SmolLM2 a third more perplexity); other matrices are quantized as above.
- gguf: Q4_0 / Q4_1 / Q8_0 tensors kept in their blocks (pagoda.quantization.gguf_native).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from pagoda.kernels.quant_linear import PackedWeight
from pagoda.model.loader import ModelFiles
from pagoda.model.weights import LoadPlan, Weight
from pagoda.quantization.methods import ON_THE_FLY, check_method, lm_head_method, quantize_weight

logger = logging.getLogger(__name__)


def load_plan(files: ModelFiles, dtype: torch.dtype, method: str | None, group_size: int,
              is_linear: Callable[[str], bool]) -> LoadPlan:
    """The weight stream of `files` under `method`, and how it loads. `is_linear(hf_name)`: whether a
    weight is a decoder Linear's matrix (the model knows: model/weights.py is_linear_weight)."""
    method = check_method(method)
    qc = files.hf_config.get("quantization_config")
    if qc is not None:
        from pagoda.quantization.checkpoint_loader import (
            check_checkpoint_config,
            checkpoint_group_size,
            checkpoint_weights,
        )

        check_checkpoint_config(qc, method, files.source)
        return LoadPlan(checkpoint_weights(files), torch.float32, _head(method or "int4", checkpoint_group_size(files)))
    if method == "gguf":
        if files.kind != "gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf model file, got the folder {files.source!r}")
        from pagoda.quantization.gguf_native import gguf_native_weights

        return LoadPlan(gguf_native_weights(files, dtype), dtype)
    if method is None:
        return LoadPlan(files.iter_weights(dtype), dtype)
    if method == "int4" and files.kind == "gguf":
        from pagoda.quantization.gguf_native import gguf_native_weights

        # codes and scales (keep_blocks=False): a Q4_K's INT4 codes are that grid
        return LoadPlan(_int4_keeping_the_grid(gguf_native_weights(files, torch.float32, keep_blocks=False),
                                               group_size, is_linear),
                        torch.float32, _head(method, group_size))
    if files.kind == "gguf":
        # A quantized GGUF (the default model) is re-quantized from its dequantized float values: the
        # float32 baseline of the benchmark runs exactly those, so the comparison is like for like.
        logger.info("quantization %s: re-quantizing the dequantized weights of %s", method, files.source)
    return LoadPlan(quantize_stream(files.iter_weights(torch.float32), method, group_size, is_linear),
                    torch.float32, _head(method, group_size))


def _head(method: str, group_size: int) -> Callable[[torch.Tensor], PackedWeight]:
    """How a float LM head is quantized under `method` (methods.lm_head_method: INT4 methods keep it INT8)."""
    return functools.partial(quantize_weight, lm_head_method(method), group_size=group_size)


def _int4_keeping_the_grid(weights: Iterable[tuple[str, Weight]], group_size: int,
                           is_linear: Callable[[str], bool]) -> Iterator[tuple[str, Weight]]:
    """A GGUF's stream under int4: INT4 blocks as stored; a Linear matrix in any other format is quantized to
    INT4 from its float values; the rest (norms, a packed embedding table) passes through."""
    for name, w in weights:
        if not is_linear(name) or (isinstance(w, PackedWeight) and w.format == "int4"):
            yield name, w
        else:
            yield name, quantize_weight("int4", w.dequantize() if isinstance(w, PackedWeight) else w, group_size)


def quantize_stream(weights: Iterable[tuple[str, Weight]], method: str, group_size: int,
                    is_linear: Callable[[str], bool]) -> Iterator[tuple[str, Weight]]:
    """Quantize each float Linear matrix (fp32 expected for best rounding) as it streams by. Every method's
    scales are per output row, so quantizing q, k and v apart equals quantizing their fused matrix."""
    assert method in ON_THE_FLY
    for name, w in weights:
        if isinstance(w, torch.Tensor) and is_linear(name):
            yield name, quantize_weight(method, w, group_size)
        else:
            yield name, w
