"""The Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3) over a flat varlen batch.

Projections are fused at load (q|k|v and gate|up) so a layer runs three matmuls, not seven; Phi-3's
checkpoints store them fused already, and load as they are.
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn

from pagoda.kernels.decoder_stack import DecoderStack
from pagoda.kernels.fused_ops import silu_and_mul, silu_and_mul_torch
from pagoda.kernels.paged_attention import AttentionMetadata
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.attention import PagedAttention
from pagoda.layers.linear import Linear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.quant_embedding import QuantEmbedding
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.lora.layer import LoRAMapping
from pagoda.model.args import ModelArgs
from pagoda.model.weights import fused_target


class LlamaAttention(nn.Module):
    def __init__(self, a: ModelArgs, rope: RotaryEmbedding, window: int = 0) -> None:
        super().__init__()
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.qkv_proj = Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias)
        # Llama's attention_bias covers o_proj too; Qwen2 and GLM-4.5 bias only q/k/v.
        self.o_proj = Linear(self.q_size, a.hidden_size, bias=_o_proj_bias(a))
        self.attn = PagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, sliding_window=window)
        self.rope = rope
        self.head_dim = a.head_dim
        # Qwen3: each q and k head is RMS-normalized (its own weight over head_dim) before RoPE.
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        return self.o_proj(self.attn.forward_qkv(qkv, positions, meta, self.rope))

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """q and k of fused qkv rows [T, (Hq + 2 Hkv) D], each head normalized in place."""
        assert self.q_norm is not None and self.k_norm is not None
        d, q, kv = self.head_dim, self.q_size, self.kv_size
        for norm, cols in ((self.q_norm, slice(0, q)), (self.k_norm, slice(q, q + kv))):
            heads = qkv[:, cols].reshape(-1, d)
            qkv[:, cols] = norm(heads).view(qkv.shape[0], -1)

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)


class LlamaMLP(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.act = silu_and_mul

    def bind_ops(self, cpp: bool) -> None:
        """At the model's prepare(): the C++ kernel (`cpp`: its KernelPolicy's choice) or torch's twin."""
        self.act = silu_and_mul if cpp else silu_and_mul_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, rope: RotaryEmbedding, window: int = 0, mlp: nn.Module | None = None) -> None:
        """`mlp`: the layer's MLP where it is not LlamaMLP (a MoE model's sparse block, model/moe.py)."""
        super().__init__()
        self.self_attn = LlamaAttention(a, rope, window)
        self.mlp = LlamaMLP(a) if mlp is None else mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output; residual: the running sum (None at the first layer).
        The residual add is fused into each norm: residual += x, then normalize."""
        if residual is None:
            residual = x.clone()
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, meta)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)


class LlamaForCausalLM(nn.Module):
    # Fused Linear -> the HF projections it holds, in order along its output rows (vLLM's packed_modules_mapping).
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # A part of an HF weight name -> the module it names here, where the names differ (Mixtral's experts).
    hf_renames: dict[str, str] = {}
    # EAGLE-3 drafting: the residual stream entering each of these layers is kept, side by side, in
    # `aux_hidden` [T, len * hidden] after every forward (spec_decode/head_proposer.py sets and reads them).
    aux_layers: tuple[int, ...] = ()
    # MTP drafting (spec_decode/mtp.py): `aux_hidden` is the forward's output (after the final norm) instead.
    aux_output: bool = False
    aux_hidden: torch.Tensor | None = None

    def __init__(self, a: ModelArgs, max_model_len: int | None = None) -> None:
        """`max_model_len`: the longest context served (None: max_position_embeddings); LongRoPE's factor
        set depends on it (layers/rotary.py)."""
        super().__init__()
        self.args = a
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling, a.rotary_dim,
                               max_model_len)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(a, rope, w, self.layer_mlp(a, i))
                                    for i, w in enumerate(a.layer_windows))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.stack: DecoderStack | None = None  # the layers as one C++ op for few-row steps (prepare())
        self.lora: LoRAMapping | None = None  # the step's adapter rows, where LoRA is on (lora/manager.py)

    def layer_mlp(self, a: ModelArgs, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP where it is not LlamaMLP (None): a MoE model's sparse blocks (model/moe.py)."""
        return None

    def module_path(self, hf_name: str) -> str:
        """An HF weight or module name as the path of what it loads into here, before fusion: without
        "model.", each dotted part renamed by `hf_renames`."""
        name = hf_name.removeprefix("model.")
        if not self.hf_renames:
            return name
        return ".".join(self.hf_renames.get(part, part) for part in name.split("."))

    def part_rows(self, fused: str, total: int) -> list[int]:
        """Output rows of each HF projection a fused Linear named `fused` (`packed_modules`) holds, in order."""
        a = self.args
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}  # other parts (gate|up): equal shares
        parts = self.packed_modules[fused]
        return [sizes.get(p, total // len(parts)) for p in parts]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. `num_layers` exits early (self-speculative drafts)."""
        out = self._forward(input_ids, positions, meta, num_layers)
        if self.aux_output and num_layers is None:
            self.aux_hidden = out
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 num_layers: int | None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        n = len(self.layers) if num_layers is None else num_layers
        capture = self.aux_layers if num_layers is None else ()
        stack = self.stack
        if stack is not None and stack.takes(x):
            lora_slots = self.lora.token_slots if self.lora is not None else None
            # The captured streams are written by the op as it passes each layer, in its one call.
            aux = x.new_empty(x.shape[0], len(capture) * x.shape[1]) if capture else None
            x, residual = stack(x, positions, meta, n, lora_slots, capture, aux)
            if aux is not None:
                self.aux_hidden = aux
            return self.norm(x, residual)
        residual = None
        streams: dict[int, torch.Tensor] = {}
        # Not self.layers[:n]: slicing a ModuleList builds a new one every step.
        for i, layer in enumerate(self.layers if num_layers is None else islice(self.layers, num_layers)):
            if i in capture:
                streams[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, positions, meta)
        if capture:
            self.aux_hidden = torch.cat([streams[i] for i in capture], dim=-1)
        return self.norm(x, residual)

    def prepare(self, policy: KernelPolicy) -> None:
        """Called once the weights are loaded (and tied): lets each layer pick its kernels under `policy`."""
        use_kernels = policy.cpp
        act_dtype = self.norm.weight.dtype
        # A GGUF table shared by the embedding and the tied lm_head stays one table in the head's kernel
        # layout (PackedWeight.rows gathers the embedding's rows from it).
        shared = isinstance(self.embed_tokens, QuantEmbedding) and self.lm_head.qweight is self.embed_tokens.pw
        prepare_kernels(self, act_dtype, policy)
        if shared:
            self.embed_tokens.pw = self.lm_head.qweight
        self.stack = self._decoder_stack() if use_kernels else None

    def _stack_linears(self) -> list[Linear]:
        """The decoder stack's linears in its order: qkv, o, gate_up, down of each layer."""
        return [p for layer in self.layers for p in
                (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    def _decoder_stack(self) -> DecoderStack | None:
        norms, qk_norms = [], []
        for layer in self.layers:
            attn = layer.self_attn
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if attn.q_norm is not None and attn.k_norm is not None:
                qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        linears = [p.stack_args() for p in self._stack_linears()]
        first = self.layers[0]
        return DecoderStack.build(norms, linears, first.input_layernorm.eps,
                                  self.attention_layers(), first.self_attn.rope, qk_norms)

    def bind_lora(self, mapping: LoRAMapping) -> None:
        """LoRA is on (lora/manager.py): each step's adapter rows are in `mapping`, and the Linears hold their
        slots; the C++ stack adds the same updates as the layers do."""
        self.lora = mapping
        if self.stack is not None:
            self.stack.bind_lora([p.lora.stack_args() if p.lora is not None else None for p in self._stack_linears()])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named float tensors into their parameters, q/k/v and gate/up into their slice of the fused
        one (`packed_modules`); returns the names loaded (model/weights.py drives this and checks them)."""
        params = dict(self.named_parameters())
        a = self.args
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and a.tie_word_embeddings:
                continue
            module, _, leaf = name.rpartition(".")
            path, index, count = fused_target(self, module)
            target = f"{path}.{leaf}"
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {a.architecture}")
            dst = params[target].data
            if count > 1:  # its slice of the fused rows
                rows = self.part_rows(path.rpartition(".")[2], dst.shape[0])
                dst = dst.narrow(0, sum(rows[:index]), rows[index])
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        return loaded

    @staticmethod
    def weight_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
        """Every weight a checkpoint of this config holds (the module function below; loader.py checks files by it)."""
        return weight_shapes(a)

    @classmethod
    def optional_weight_shapes(cls, a: ModelArgs) -> dict[str, tuple[int, ...]]:
        """Weights a checkpoint may hold beside those, which the model does not load (GLM-4.5's MTP layers)."""
        return {}

    def check_weights(self, loaded: set[str]) -> None:
        """Raise unless every weight a checkpoint of this config holds was loaded (HF names, any prefix)."""
        missing = self.weight_shapes(self.args).keys() - {n.removeprefix("model.") for n in loaded}
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {sorted(missing)[:3]}")


def prepare_kernels(module: nn.Module, act_dtype: torch.dtype, policy: KernelPolicy) -> None:
    """Each Linear in `module` picks its kernel under `policy`; norms, rope, attention and MLPs run the fused C++
    ops or torch, as the policy says."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.prepare(act_dtype, policy)
        elif hasattr(m, "bind_ops"):
            m.bind_ops(policy.cpp)


def weight_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF weight name (without "model.") -> shape, for every weight a checkpoint of this config holds."""
    h, inter, q, kv = a.hidden_size, a.intermediate_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (a.vocab_size, h), "norm.weight": (h,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, h)
    layer = {"self_attn.o_proj.weight": (h, q), "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    if a.architecture == "Phi3ForCausalLM":  # stored fused, in the order Pagoda's fused Linears hold them
        layer |= {"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * inter, h)}
    else:
        layer |= {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h), "mlp.gate_proj.weight": (inter, h),
                  "mlp.up_proj.weight": (inter, h)}
    if a.qk_norm:
        layer |= {"self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,)}
    if a.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if _o_proj_bias(a):
            layer["self_attn.o_proj.bias"] = (h,)
    for i in range(a.num_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _o_proj_bias(a: ModelArgs) -> bool:
    return a.attention_bias and a.architecture not in ("Qwen2ForCausalLM", "Glm4MoeForCausalLM")
