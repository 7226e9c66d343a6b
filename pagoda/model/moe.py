"""Mixtral and Qwen3-MoE: Llama-family decoders whose MLPs are sparse mixture-of-experts blocks.

Attention is Llama's (Qwen3-MoE with its per-head q/k norms, ModelArgs.qk_norm); each sparse layer's MLP is a
SparseMoeBlock (layers/moe.py), and Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep
LlamaMLP. Routing follows each model's transformers code (ModelArgs.moe): Mixtral renormalizes its top-k
weights, Qwen3-MoE only with norm_topk_prob. Weights load through Llama's loader: each expert's gate and up
fuse into its gate_up_proj (`packed_modules`), and Mixtral's names map onto these (`hf_renames`). The C++
decoder stack runs dense layers only, so these models run layer by layer, with the experts as one op.
"""
from __future__ import annotations

from torch import nn

from pagoda.kernels.decoder_stack import DecoderStack
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.moe import SparseMoeBlock
from pagoda.model.args import ModelArgs, MoeArgs
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.llama import weight_shapes as llama_weight_shapes


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE's names: layers.N.mlp.gate (router), layers.N.mlp.experts.E.{gate,up,down}_proj."""

    # The HF module of a sparse layer's router and experts (Mixtral's differs).
    hf_block = "mlp"
    hf_expert_parts = ("gate_proj", "up_proj", "down_proj")

    def _mlp(self, a: ModelArgs, layer: int) -> nn.Module | None:
        moe = _moe(a)
        if not moe.sparse_layers[layer]:
            return None  # a dense LlamaMLP of a.intermediate_size
        return SparseMoeBlock(a.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize,
                              moe.round_weights)

    def prepare(self, policy: KernelPolicy) -> None:
        """Llama's kernel choice per Linear (the experts' too), then each block gathers its experts for the op."""
        super().prepare(policy)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.prepare_experts(policy)

    def _decoder_stack(self) -> DecoderStack | None:
        return None  # the C++ stack runs dense MLPs only

    @classmethod
    def weight_shapes(cls, a: ModelArgs) -> dict[str, tuple[int, ...]]:
        """Llama's weights, with each sparse layer's MLP replaced by its router and experts (HF names)."""
        moe = _moe(a)
        shapes = llama_weight_shapes(a)
        h, inter = a.hidden_size, moe.intermediate_size
        gate, up, down = cls.hf_expert_parts
        for i, sparse in enumerate(moe.sparse_layers):
            if not sparse:
                continue
            for part in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"layers.{i}.mlp.{part}.weight"]
            block = f"layers.{i}.{cls.hf_block}"
            shapes[f"{block}.gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                expert = f"{block}.experts.{e}"
                shapes |= {f"{expert}.{gate}.weight": (inter, h), f"{expert}.{up}.weight": (inter, h),
                           f"{expert}.{down}.weight": (h, inter)}
        return shapes


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral's names: layers.N.block_sparse_moe.gate, layers.N.block_sparse_moe.experts.E.w1 (gate), w3 (up),
    w2 (down), loaded as Qwen3-MoE's."""

    hf_block = "block_sparse_moe"
    hf_expert_parts = ("w1", "w3", "w2")
    hf_renames = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _moe(a: ModelArgs) -> MoeArgs:
    if a.moe is None:
        raise ValueError(f"{a.architecture}: the config has no mixture-of-experts settings")
    return a.moe
