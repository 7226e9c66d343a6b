"""Mixtral, Qwen3-MoE and GLM-4.5: Llama-family decoders whose MLPs are sparse mixture-of-experts blocks.

Attention is Llama's (Qwen3-MoE with its per-head q/k norms, ModelArgs.qk_norm); each sparse layer's MLP is a
SparseMoeBlock (layers/moe.py), and Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep
LlamaMLP. Routing follows each model's transformers code (ModelArgs.moe): Mixtral renormalizes its top-k
weights, Qwen3-MoE only with norm_topk_prob; GLM-4.5 routes by grouped sigmoid scores and adds shared experts.
Weights load through Llama's loader: each expert's gate and up fuse into its gate_up_proj (`packed_modules`),
and Mixtral's names map onto these (`hf_renames`). The C++ decoder stack runs dense layers only, so these
models run layer by layer, with the experts as one op.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
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

    def layer_mlp(self, a: ModelArgs, layer: int) -> nn.Module | None:
        moe = _moe(a)
        # Past the decoder layers: an MTP layer (GLM-4.5's), sparse as every layer after first_k_dense_replace.
        if layer < a.num_layers and not moe.sparse_layers[layer]:
            return None  # a dense LlamaMLP of a.intermediate_size
        return SparseMoeBlock(a.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k, moe.renormalize,
                              moe.round_weights, moe.grouped, moe.shared_intermediate)

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
            if moe.grouped is not None:
                shapes[f"{block}.gate.e_score_correction_bias"] = (moe.num_experts,)
            if moe.shared_intermediate:
                s = moe.shared_intermediate
                shapes |= {f"{block}.shared_experts.gate_proj.weight": (s, h),
                           f"{block}.shared_experts.up_proj.weight": (s, h),
                           f"{block}.shared_experts.down_proj.weight": (h, s)}
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


class Glm4MoeForCausalLM(MoeForCausalLM):
    """GLM-4.5 (transformers' Glm4Moe): Qwen3-MoE's names, q/k/v biases (o_proj has none), half of each head
    rotated, optional q/k head norms, the first first_k_dense_replace layers dense. Its checkpoints keep their
    multi-token prediction layers after the decoder layers (layers.N..., ModelArgs.num_mtp_layers): the target
    skips them, and speculative decoding's method "mtp" loads the first (spec_decode/mtp.py)."""

    @classmethod
    def mtp_weight_shapes(cls, a: ModelArgs, index: int = 0) -> dict[str, tuple[int, ...]]:
        """MTP layer `index`'s weights (HF names, without "model."): a sparse decoder layer as the others, and
        enorm, hnorm, eh_proj (the [embedding | target state] fusion) and shared_head.{norm,head} (as
        vLLM's DeepSeek/GLM MTP reads them); embed_tokens, where stored, is a copy of the target's, not loaded."""
        moe = _moe(a)
        n, h = a.num_layers + index, a.hidden_size
        wide = dataclasses.replace(a, num_layers=n + 1, layer_windows=[0] * (n + 1),
                                   moe=dataclasses.replace(moe, sparse_layers=[True] * (n + 1)))
        prefix = f"layers.{n}."
        shapes = {k: v for k, v in cls.weight_shapes(wide).items() if k.startswith(prefix)}
        return shapes | {prefix + k: v for k, v in {
            "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
            "shared_head.norm.weight": (h,), "shared_head.head.weight": (a.vocab_size, h),
            "embed_tokens.weight": (a.vocab_size, h)}.items()}

    @classmethod
    def optional_weight_shapes(cls, a: ModelArgs) -> dict[str, tuple[int, ...]]:
        return {k: v for i in range(a.num_mtp_layers) for k, v in cls.mtp_weight_shapes(a, i).items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Llama's, without the MTP layers (loaded by their drafter, when speculation asks for them)."""
        n = self.args.num_layers
        return super().load_weights((name, w) for name, w in weights if _layer_index(name) < n)


def _layer_index(name: str) -> int:
    """The decoder layer an HF weight name belongs to (-1: none)."""
    parts = name.removeprefix("model.").split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() else -1


def _moe(a: ModelArgs) -> MoeArgs:
    if a.moe is None:
        raise ValueError(f"{a.architecture}: the config has no mixture-of-experts settings")
    return a.moe
