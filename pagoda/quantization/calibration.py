"""Calibration plumbing shared by GPTQ and AWQ: text -> token windows -> per-layer linear inputs.

The vehicle is an fp32 Hugging Face transformers model holding the same weights pagoda loads (GGUF
tensors are dequantized by pagoda's own loader), because its unfused q/k/v/o/gate/up/down linears
are exactly the names the INT4 checkpoint uses and forward hooks reach each one. Layers are processed
one at a time, as in GPTQ: the inputs of layer 0 are captured once, each layer is quantized, and the
*quantized* layer's outputs become the next layer's inputs, so later layers calibrate against the
errors of earlier ones.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagoda.quantization.int4_format import Int4Weight

# The linears of a Llama-family decoder layer, in data-flow order, by their HF module paths.
ATTN_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
ATTN_OUT = ("self_attn.o_proj",)
MLP_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
MLP_DOWN = ("mlp.down_proj",)
LINEAR_GROUPS = (ATTN_QKV, ATTN_OUT, MLP_GATE_UP, MLP_DOWN)


def calibration_windows(token_ids: list[int], num_samples: int, seq_len: int) -> torch.Tensor:
    """Up to `num_samples` windows of `seq_len` tokens [n, seq_len], spread evenly over the text
    (non-overlapping where the text is long enough; fewer windows where it is too short for any)."""
    total = len(token_ids)
    if total < seq_len:
        raise ValueError(f"calibration text has {total} tokens, fewer than seq_len={seq_len}")
    n = max(1, min(num_samples, total // seq_len))
    starts = torch.linspace(0, total - seq_len, n).round().long().tolist() if n > 1 else [0]
    ids = torch.tensor(token_ids, dtype=torch.long)
    return torch.stack([ids[s:s + seq_len] for s in starts])


def load_calibration_ids(model_path: str | None, text_path: str, num_samples: int, seq_len: int) -> torch.Tensor:
    from pagoda.model.loader import resolve_model_files
    from pagoda.model.tokenizer import load_tokenizer

    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    tok = load_tokenizer(resolve_model_files(model_path))
    return calibration_windows(tok.encode(text, add_special_tokens=False), num_samples, seq_len)


def load_hf_float_model(model_path: str | None) -> tuple[nn.Module, dict[str, Any]]:
    """An fp32 transformers CausalLM with the weights pagoda reads from `model_path`, and its HF config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.model.loader import resolve_model_files

    files = resolve_model_files(model_path)
    cfg = dict(files.hf_config)
    cfg.pop("quantization_config", None)
    hf_cfg = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    state = dict(files.iter_weights(torch.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and hf_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if hf_cfg.tie_word_embeddings:
        model.tie_weights()
    return model, cfg


@dataclass
class LayerInputs:
    """The calibration batch at one layer boundary: hidden states per chunk, and the call kwargs
    (rotary embeddings, mask) the HF model passes to every decoder layer for that chunk."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    kwargs: list[dict[str, Any]] = field(default_factory=list)

    def run(self, layer: nn.Module) -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for h, kw in zip(self.hidden, self.kwargs):
                out = layer(h, **kw)
                outs.append(out[0] if isinstance(out, tuple) else out)
        return outs

    def feed(self, layer: nn.Module) -> None:
        """Run the layer on every chunk for its hooks' sake (a hook may cut the forward short)."""
        with torch.no_grad():
            for h, kw in zip(self.hidden, self.kwargs):
                try:
                    layer(h, **kw)
                except _Stop:
                    pass


class _Stop(Exception):
    """Raised by a hook once it has what it needs, to skip the rest of a forward."""


def capture_first_layer_inputs(model: nn.Module, ids: torch.Tensor, batch_size: int = 8) -> LayerInputs:
    """Run the model up to decoder layer 0 and keep what it receives (a pre-hook that stops the forward)."""
    inputs = LayerInputs()
    layer0 = decoder_layers(model)[0]

    def grab(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs.hidden.append(args[0] if args else kwargs.pop("hidden_states"))
        inputs.kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _Stop

    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for chunk in ids.split(batch_size):
                try:
                    model(input_ids=chunk, use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return inputs


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


@contextmanager
def capture_inputs(layer: nn.Module, names: tuple[str, ...], sink: Callable[[str, torch.Tensor], None],
                   stop: bool = False) -> Iterator[None]:
    """While active, every call of the named linears hands its input, flattened to [tokens, K], to sink.
    With stop, the forward is cut short (use LayerInputs.feed) once all of them have been called."""
    handles = []
    seen: set[str] = set()
    for name in names:
        def hook(_mod: nn.Module, args: tuple, _out: Any, name: str = name) -> None:
            x = args[0]
            sink(name, x.reshape(-1, x.shape[-1]).detach())
            seen.add(name)
            if stop and len(seen) == len(names):
                seen.clear()
                raise _Stop
        handles.append(layer.get_submodule(name).register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# quantize_layer(layer_index, layer, inputs) quantizes the layer in place (its linears then hold
# the dequantized weights) and returns {module path within the layer: Int4Weight}.
LayerQuantizer = Callable[[int, nn.Module, LayerInputs], dict[str, Int4Weight]]


def quantize_sequentially(model: nn.Module, ids: torch.Tensor, quantize_layer: LayerQuantizer,
                          batch_size: int = 8, log: Callable[[str], None] | None = None) -> dict[str, Int4Weight]:
    """Quantize every decoder layer in order; returns {HF prefix (model.layers.i.<path>): Int4Weight}."""
    inputs = capture_first_layer_inputs(model, ids, batch_size)
    result: dict[str, Int4Weight] = {}
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        for path, w in quantize_layer(i, layer, inputs).items():
            result[f"model.layers.{i}.{path}"] = w
        inputs = LayerInputs(inputs.run(layer), inputs.kwargs)
        if log:
            log(f"layer {i + 1}/{len(layers)} quantized")
    return result
