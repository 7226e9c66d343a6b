"""Load a model from a stream of HF-named weights, each a float tensor or a PackedWeight.

Every source yields that stream: a safetensors folder or a GGUF file as floats (model/loader.py
`ModelFiles.iter_weights`), a GGUF's Q4/Q8 blocks as stored and a saved Pagoda INT4 checkpoint
(pagoda/quantization); a quantization method is a transform on the stream (pagoda/quantization/loading.py).
Fusion (q|k|v, gate|up) happens here once, from the model's `packed_modules`: float parts are copied
into their slice of the fused parameter, packed parts are concatenated along output rows.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels.quant_linear import PackedWeight
from pagoda.layers.linear import Linear
from pagoda.layers.quant_embedding import QuantEmbedding

Weight = torch.Tensor | PackedWeight


@dataclass(frozen=True)
class LoadPlan:
    """How a stream loads: `staging`, the dtype float parameters hold while it loads (fp32 where packed
    layers keep fp32 biases), cast to the compute dtype after; `quantize_head`, what a float LM head (tied or
    not) becomes once loaded (None: it stays float)."""

    weights: Iterable[tuple[str, Weight]]
    staging: torch.dtype
    quantize_head: Callable[[torch.Tensor], PackedWeight] | None = None


def fused_target(model: nn.Module, hf_module: str) -> tuple[str, int, int]:
    """The module path an HF module (a weight's name without ".weight") loads into, its part's index and
    the number of parts: layers.0.self_attn.q_proj -> (layers.0.self_attn.qkv_proj, 0, 3); (its own path,
    0, 1) where it is not fused. The model's `hf_renames` apply first (Mixtral's experts.0.w1 is
    experts.0.gate_proj)."""
    path = model.module_path(hf_module)
    parent, _, part = path.rpartition(".")
    for fused, parts in model.packed_modules.items():
        if part in parts:
            return f"{parent}.{fused}", parts.index(part), len(parts)
    return path, 0, 1


def is_linear_weight(model: nn.Module, hf_name: str) -> bool:
    """Whether an HF weight is a decoder Linear's matrix (what on-the-fly quantization transforms)."""
    if not hf_name.endswith(".weight") or hf_name.removeprefix("model.") == "lm_head.weight":
        return False
    path = fused_target(model, hf_name.removesuffix(".weight"))[0]
    try:
        return isinstance(model.get_submodule(path), Linear)
    except AttributeError:
        return False


def load_weights(model: nn.Module, plan: LoadPlan, dtype: torch.dtype) -> None:
    """Load `plan`'s stream into `model` (on its device), tie the LM head, quantize it where the plan says,
    and leave every float parameter in `dtype`."""
    set_param_dtype(model, plan.staging)
    packed: dict[str, PackedWeight] = {}

    def floats() -> Iterator[tuple[str, torch.Tensor]]:
        for name, w in plan.weights:
            if isinstance(w, PackedWeight):
                packed[name.removesuffix(".weight")] = w
            else:
                yield name, w

    loaded = model.load_weights(floats())
    unfused: list[tuple[str, torch.Tensor]] = []
    loaded |= _attach_packed(model, packed, plan.staging, dtype, unfused)
    loaded |= model.load_weights(unfused)
    model.check_weights(loaded)
    tie_lm_head(model)
    head = model.lm_head
    if plan.quantize_head is not None and head.qweight is None:
        head.set_quantized(plan.quantize_head(head.weight.detach()))
    set_param_dtype(model, dtype)


def _attach_packed(model: nn.Module, packed: dict[str, PackedWeight], staging: torch.dtype,
                   dtype: torch.dtype, unfused: list[tuple[str, torch.Tensor]]) -> set[str]:
    """Put HF-prefixed packed weights into the model's (fused) Linears, or a packed embedding table into a
    QuantEmbedding that dequantizes to the compute `dtype`. Fused parts are concatenated along output rows;
    where they cannot be (a part is float, or the formats differ), the parts are dequantized (to `staging`)
    into `unfused` instead. Returns the HF weight names now loaded."""
    groups: dict[str, list[PackedWeight | None]] = {}
    names: dict[str, list[str]] = {}
    for prefix, pw in packed.items():
        path, index, count = fused_target(model, prefix)
        groups.setdefault(path, [None] * count)[index] = pw
        names.setdefault(path, []).append(prefix)
    loaded: set[str] = set()
    for path, parts in groups.items():
        module = model.get_submodule(path)
        if isinstance(module, nn.Embedding):  # a GGUF's Q8_0/Q4 table stays packed: rows dequantize as gathered
            model.embed_tokens = QuantEmbedding(parts[0], dtype)  # type: ignore[arg-type]
            loaded.add(names[path][0] + ".weight")
            continue
        try:
            if any(p is None for p in parts):
                raise ValueError("a part is not packed")
            fused = parts[0] if len(parts) == 1 else PackedWeight.cat(parts)  # type: ignore[arg-type]
        except ValueError:
            unfused.extend((n + ".weight", packed[n].dequantize(staging)) for n in names[path])
            continue
        module.set_quantized(fused)
        loaded.update(n + ".weight" for n in names[path])
    return loaded


def tie_lm_head(model: nn.Module) -> None:
    """A tied LM head reads the embedding's table: the same float weight, or the same packed table."""
    if not model.args.tie_word_embeddings:
        return
    if isinstance(model.embed_tokens, QuantEmbedding):
        model.lm_head.set_quantized(model.embed_tokens.pw)  # no second copy
    else:
        model.lm_head.weight = model.embed_tokens.weight


def set_param_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only (the rope tables are buffers that stay fp32); quantized layers keep fp32 bias."""
    quant_params = {id(m.bias) for m in model.modules() if isinstance(m, Linear) and m.qweight is not None}
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and id(p) not in quant_params:
            p.data = p.data.to(dtype)
