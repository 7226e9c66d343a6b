"""A PEFT LoRA adapter read by hand (adapter_config.json + adapter_model.safetensors), checked against a model.

Only safetensors are read: a pickled adapter_model.bin could run code on load, so it is refused by name.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

# The projections an adapter may target, by PEFT's module name (the last part of the HF module path).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


@dataclass
class LoRAModule:
    """One HF projection's low-rank update: delta W = scale * B @ A."""
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class LoRAAdapter:
    name: str
    rank: int                       # the largest rank among its modules
    modules: dict[str, LoRAModule]  # HF module path ("model.layers.0.self_attn.q_proj") -> its update
    key: str                        # a digest of its files: what the prefix cache keys its KV by


def _error(name: str, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {message}")


def _pattern_value(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module path ending in it (as a regex)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder; ValueError naming the adapter for anything it cannot serve."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise _error(name, f"no adapter_config.json in {folder}")
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise _error(name, "adapter_model.bin is a pickle and is not loaded; save it with safetensors")
        raise _error(name, f"no adapter_model.safetensors in {folder}")
    raw_config, raw_weights = config_file.read_bytes(), weights_file.read_bytes()
    try:
        config = json.loads(raw_config)
        tensors = load_safetensors(raw_weights)
    except Exception as e:  # a truncated or corrupt file, whichever library says so
        raise _error(name, f"cannot read its files: {e}") from None
    if not isinstance(config, dict):
        raise _error(name, "adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _error(name, f"peft_type {config.get('peft_type')!r} is not LORA")
    for flag, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save")):
        if config.get(flag):
            raise _error(name, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _error(name, f"bias {config.get('bias')!r} is not supported (only 'none')")
    alpha, rslora = float(config.get("lora_alpha", config.get("r", 8))), bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise _error(name, f"tensor {key!r} is not a lora_A/lora_B weight of a projection")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not pairs:
        raise _error(name, "adapter_model.safetensors holds no LoRA weights")
    modules = {}
    for module, ab in pairs.items():
        if module.rpartition(".")[2] not in TARGETS:
            raise _error(name, f"target module {module!r} is not an attention or MLP projection")
        if set(ab) != {"lora_A", "lora_B"}:
            raise _error(name, f"{module!r} lacks its {'lora_B' if 'lora_A' in ab else 'lora_A'} weight")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _error(name, f"{module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not compose")
        r = a.shape[0]
        if r > max_rank:
            raise _error(name, f"rank {r} of {module!r} exceeds max_lora_rank {max_rank}")
        expected = _pattern_value(rank_pattern, module, config.get("r", r))
        if expected != r:
            raise _error(name, f"{module!r} has rank {r} but adapter_config.json says {expected}")
        a_alpha = _pattern_value(alpha_pattern, module, alpha)
        scale = a_alpha / math.sqrt(r) if rslora else a_alpha / r
        modules[module] = LoRAModule(a.float(), b.float(), scale)
    key = hashlib.sha256(raw_config + raw_weights).hexdigest()
    return LoRAAdapter(name, max(m.a.shape[0] for m in modules.values()), modules, key)
