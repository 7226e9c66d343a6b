"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from torch import nn

from pagoda.model.args import ModelArgs
from pagoda.model.gemma import GemmaForCausalLM
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.moe import Glm4MoeForCausalLM, MixtralForCausalLM, MoeForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # + its sliding window on every layer (ModelArgs.layer_windows)
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + RMSNorm over each q and k head (ModelArgs.qk_norm)
    # Llama's layers with q|k|v and gate|up stored fused, LongRoPE and partial rotary (layers/rotary.py), and
    # its sliding window where the config sets one (Phi-3-mini-4k's 2047).
    "Phi3ForCausalLM": LlamaForCausalLM,
    # Gemma's (1 + w) norms before and after attention and MLP, scaled embedding, GELU MLP, logit soft-caps,
    # sliding-window layers between global ones (Gemma 3: local RoPE base, q/k head norms).
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    # Llama's attention (Qwen3-MoE: with q/k head norms) and sparse mixture-of-experts MLPs (layers/moe.py).
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    # GLM-4.5: grouped sigmoid routing, shared experts, q/k/v biases, half-rotary heads; its MTP layers draft.
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
}


def model_class(args: ModelArgs) -> type[nn.Module]:
    try:
        return _REGISTRY[args.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {args.architecture!r}; supported: "
                         f"{', '.join(sorted(_REGISTRY))}") from None
