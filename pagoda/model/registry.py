"""Architecture name (config.json `architectures`) -> model class."""
from __future__ import annotations

from torch import nn

from pagoda.model.args import ModelArgs
from pagoda.model.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # no sliding window yet: exact up to its window
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + RMSNorm over each q and k head (ModelArgs.qk_norm)
}


def model_class(args: ModelArgs) -> type[nn.Module]:
    try:
        return _REGISTRY[args.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {args.architecture!r}; supported: "
                         f"{', '.join(sorted(_REGISTRY))}") from None
