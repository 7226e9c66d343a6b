"""Multi-token prediction (MTP) drafting with the MTP layer a checkpoint ships (GLM-4.5, as DeepSeek-V3 stores it).

The layer sits after the decoder layers (model.layers.N, N = num_hidden_layers) and is read as vLLM's
DeepSeek/GLM MTP reads it. One step at position p takes the target's hidden state h (after its final norm) at
p, or the layer's own previous output, and the token at p + 1, and predicts the token at p + 2:

  x = eh_proj([enorm(embed(token)) | hnorm(h)])       the embedding is zeroed at position 0, as in vLLM
  out = decoder_layer(x)                              a decoder layer of the target's own kind, pre-norm
  logits = shared_head.head(shared_head.norm(out))    over the whole vocabulary

It drafts through the same proposer as an EAGLE-3 head (head_proposer.py): the target's states are kept from
its own forward (LlamaForCausalLM.aux_output), the layer's KV lives in a small pool beside the target's, and a
chain or a draft tree reuses the one layer at every depth (vLLM's choice where a checkpoint has one MTP layer).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagoda.kernels.paged_attention import AttentionMetadata, k_cache_shape
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.linear import Linear
from pagoda.layers.moe import SparseMoeBlock
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.model.args import ModelArgs
from pagoda.model.llama import LlamaDecoderLayer, LlamaForCausalLM, prepare_kernels
from pagoda.model.loader import ModelFiles
from pagoda.quantization.methods import quantize_linears


class SharedHead(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.head = Linear(a.hidden_size, a.vocab_size, bias=False)


class MtpHead(LlamaDecoderLayer):
    """The MTP layer: a decoder layer (its self_attn, mlp and norms keep the checkpoint's names) with the fusion
    in front and the shared head behind; `embed` is the target's embedding."""

    # The target family's loading rules (q|k|v and gate|up fused, each part's rows) for the layer's names.
    packed_modules = LlamaForCausalLM.packed_modules
    hf_renames: dict[str, str] = {}
    module_path = LlamaForCausalLM.module_path
    part_rows = LlamaForCausalLM.part_rows
    load_weights = LlamaForCausalLM.load_weights

    def __init__(self, a: ModelArgs, mlp: nn.Module | None, embed: Callable[[torch.Tensor], torch.Tensor],
                 max_model_len: int | None = None) -> None:
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling, a.rotary_dim,
                               max_model_len)
        super().__init__(a, rope, 0, mlp)
        self.args = a
        self.hidden_size = a.hidden_size
        self.draft_vocab_size = a.vocab_size
        self.enorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hnorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.eh_proj = Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.shared_head = SharedHead(a)
        self._target_embed = (embed,)  # a tuple: not registered as this module's own

    @property
    def dtype(self) -> torch.dtype:
        return self.enorm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target_embed[0](ids)

    def forward(self, input_ids: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                meta: AttentionMetadata, from_target: bool) -> torch.Tensor:
        """One step per row: the next state [T, H] (pre-norm). `state` is the target's normed output or the
        layer's own previous output: both enter through hnorm (`from_target` changes nothing here)."""
        emb = self.embed(input_ids).to(state.dtype).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(state)], dim=-1))
        h, residual = LlamaDecoderLayer.forward(self, x, None, positions, meta)
        return h + residual

    __call__ = forward

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary."""
        return self.shared_head.head(self.shared_head.norm(state)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the draft vocabulary is the target's

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """The layer's paged K and V, [num_blocks, Hkv, block_size, D], in the head's dtype."""
        a, attn, dtype = self.args, self.self_attn.attn, self.dtype
        shape = (num_blocks, a.num_kv_heads, block_size, a.head_dim)
        attn.k_cache = torch.empty(k_cache_shape(*shape, dtype, attn.fused), dtype=dtype)
        attn.v_cache = torch.empty(shape, dtype=dtype)


def load_mtp_head(files: ModelFiles, target: LlamaForCausalLM, dtype: torch.dtype, policy: KernelPolicy,
                  max_model_len: int | None = None, quantization: str | None = None) -> MtpHead:
    """The first MTP layer of the target's checkpoint (safetensors; weights are never unpickled). A checkpoint
    without its weights fails naming the first missing one. `quantization`: as load_head's."""
    a = target.args
    if a.num_mtp_layers < 1:
        raise ValueError(f"speculative_config: method 'mtp' needs a checkpoint with MTP layers "
                         f"(num_nextn_predict_layers); this {a.architecture} config has none")
    if files.kind != "hf":
        raise ValueError("speculative_config: method 'mtp' reads the MTP layer of a safetensors checkpoint, "
                         "not a GGUF file")
    expected = type(target).mtp_weight_shapes(a)  # type: ignore[attr-defined]
    prefix = f"layers.{a.num_layers}."
    with torch.device("meta"):
        head = MtpHead(a, target.layer_mlp(a, a.num_layers), target.embed_tokens, max_model_len)
    head = head.to_empty(device="cpu")
    # A stored embed_tokens is a copy of the target's (DeepSeek-V3's layout): the target's is used, not a second one.
    weights = ((name.removeprefix("model.").removeprefix(prefix), w) for name, w in files.iter_weights(
        torch.float32, lambda n: n.startswith(f"model.{prefix}") and not n.endswith("embed_tokens.weight")))
    loaded = head.load_weights(weights)
    missing = sorted(k for k in expected
                     if k.removeprefix(prefix) not in loaded and not k.endswith("embed_tokens.weight"))
    if missing:
        raise ValueError(f"{files.source}: the MTP layer is missing {len(missing)} weight(s), e.g. {missing[:3]}")
    head = head.to(dtype)
    head.self_attn.rope.materialize(torch.device("cpu"))  # fp32 tables, after the cast (the kernels read fp32)
    if quantization is not None:
        quantize_linears(head, quantization, head.shared_head.head)
    prepare_kernels(head, dtype, policy)
    if isinstance(head.mlp, SparseMoeBlock):
        head.mlp.prepare_experts(policy)
    return head.eval()
