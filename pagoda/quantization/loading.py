"""Load a model's weights under a quantization method (the one entry ModelRunner calls).

- None: weights as stored (GGUF dequantized to float), unless the folder is a saved INT4
  checkpoint (config.json quantization_config), which always loads quantized.
- int8 / int4 / fp8: float weights loaded in fp32, every Linear (including a tied lm_head)
  quantized on the fly, the rest cast to the compute dtype.
- gguf: Q4_0 / Q4_1 / Q8_0 tensors kept in their blocks (pagoda.quantization.gguf_native).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from pagoda.kernels.quant_linear import PackedWeight
from pagoda.layers.linear import Linear
from pagoda.model.loader import ModelFiles
from pagoda.quantization.methods import ON_THE_FLY, check_method, quantize_weight

logger = logging.getLogger(__name__)

# The tied lm_head (SmolLM2: 49152 x 576, a fifth of the weights) is quantized too: it is read
# every decode step, and greedy agreement with float stays as good (tests/test_quantization.py).
QUANTIZE_LM_HEAD = True


def lm_head_method(method: str) -> str:
    """INT4 methods keep the LM head at INT8: on GPL-3 an int4 (RTN) head alone cost SmolLM2 +6.7%
    perplexity over a float head (GPTQ g32 checkpoint: 20.37 vs 19.09), an int8 head +0.07% (19.11)."""
    return "int8" if method == "int4" else method

# HF unfused projection -> (fused Linear, position among its parts, number of parts).
_FUSED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
          "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2)}


def load_quantized_model(model: nn.Module, files: ModelFiles, dtype: torch.dtype, method: str | None,
                         group_size: int = 128) -> None:
    """Fill `model` (already on its device, params in `dtype`) with weights under `method`; ties lm_head."""
    method = check_method(method)
    qc = files.hf_config.get("quantization_config")
    if qc is not None:
        from pagoda.quantization.checkpoint_loader import check_checkpoint_config, load_int4_checkpoint

        check_checkpoint_config(qc, method, files.source)
        load_int4_checkpoint(model, files, dtype)
        return
    if method == "gguf":
        if files.kind != "gguf":
            raise ValueError(f"quantization 'gguf' needs a .gguf model file, got the folder {files.source!r}")
        from pagoda.quantization.gguf_native import load_gguf_native

        load_gguf_native(model, files, dtype)
        return
    if method is None:
        model.load_weights(files.iter_weights(dtype))
        tie_lm_head(model)
        return
    if files.kind == "gguf":
        # A quantized GGUF (the default model) is re-quantized from its dequantized float values: the
        # float32 baseline of the benchmark runs exactly those, so the comparison is like for like.
        logger.info("quantization %s: re-quantizing the dequantized weights of %s", method, files.source)
    _set_param_dtype(model, torch.float32)
    model.load_weights(files.iter_weights(torch.float32))
    tie_lm_head(model)
    quantize_linears(model, method, group_size)
    _set_param_dtype(model, dtype)


def tie_lm_head(model: nn.Module) -> None:
    if model.args.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight


def quantize_linears(model: nn.Module, method: str, group_size: int = 128) -> None:
    """Replace every float Linear's weight (fp32 expected for best rounding) by its quantized form."""
    assert method in ON_THE_FLY
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or m.qweight is not None:
            continue
        if name == "lm_head" and not QUANTIZE_LM_HEAD:
            continue
        m.set_quantized(quantize_weight(lm_head_method(method) if name == "lm_head" else method,
                                        m.weight.detach(), group_size))


def _set_param_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only (the rope tables are buffers that stay fp32); quantized layers keep fp32 bias."""
    quant_params = {id(m.bias) for m in model.modules() if isinstance(m, Linear) and m.qweight is not None}
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and id(p) not in quant_params:
            p.data = p.data.to(dtype)


def attach_packed(model: nn.Module, packed: dict[str, PackedWeight], dtype: torch.dtype,
                  floats: list[tuple[str, torch.Tensor]]) -> set[str]:
    """Put HF-prefixed packed weights into the model's (fused) Linears.

    Fused parts (q|k|v, gate|up) are concatenated along output rows; where they cannot be (a part is
    missing or formats differ), the parts are dequantized and appended to `floats` instead.
    Returns the HF weight names now loaded (for load_weights' completeness check)."""
    groups: dict[str, list[PackedWeight | None]] = {}
    names: dict[str, list[str]] = {}
    for prefix, pw in packed.items():
        short = prefix.removeprefix("model.")
        part = short.rsplit(".", 1)[-1]
        if part in _FUSED:
            target, idx, count = _FUSED[part]
            key = short.rsplit(".", 1)[0] + "." + target
            groups.setdefault(key, [None] * count)[idx] = pw
            names.setdefault(key, []).append(prefix)
        else:
            groups[short] = [pw]
            names[short] = [prefix]
    provided: set[str] = set()
    for key, parts in groups.items():
        module = model.get_submodule(key)
        try:
            if any(p is None for p in parts):
                raise ValueError("missing part")
            fused = parts[0] if len(parts) == 1 else PackedWeight.cat(parts)  # type: ignore[arg-type]
        except ValueError:
            floats.extend((n + ".weight", packed[n].dequantize(dtype)) for n in names[key])
            continue
        module.set_quantized(fused)
        provided.update(n + ".weight" for n in names[key])
    return provided


def load_with_packed(model: nn.Module, packed: dict[str, PackedWeight], floats: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype, extra_provided: Iterable[str] = ()) -> None:
    """Load float tensors through model.load_weights and packed ones into their Linears."""
    floats = list(floats)
    provided = attach_packed(model, packed, dtype, floats)
    model.load_weights(floats, provided=provided | set(extra_provided))
