"""An EAGLE-3 draft head in the published format (the one vLLM, SGLang and SpecForge read and write).

A folder with `config.json` (architectures ["LlamaForCausalLMEagle3"], the head's own sizes, `draft_vocab_size`,
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors`:

  fc.weight                          [H, 3 * H_target]   the three captured target states -> one
  midlayer.input_layernorm.weight    [H]                 the token's embedding, normalized
  midlayer.hidden_norm.weight        [H]                 the incoming state, normalized
  midlayer.self_attn.{q,k,v}_proj    [*, 2 * H]          attention over [embedding | state]
  midlayer.self_attn.o_proj, midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj
  norm.weight, lm_head.weight        [draft_vocab, H]    logits over the draft vocabulary
  d2t                                int64 [draft_vocab]  draft id + d2t[draft id] = target id
  t2d                                bool [vocab]         (not needed to draft; written for other readers)
  embed_tokens.weight                optional: the target's embedding is used where absent

One step at position p takes the state s (fc of the target's captured states at p, or the head's own
previous output) and the token at p + 1, and predicts the token at p + 2:

  h = o(attn(qkv([norm_in(embed(token)) | norm_hidden(s)]))) + s
  out = h + mlp(norm_post(h))           the next step's state (pre-norm)
  logits = lm_head(norm(out))
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagoda.kernels.paged_attention import AttentionMetadata, k_cache_shape
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.linear import Linear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.model.args import ModelArgs
from pagoda.model.llama import LlamaAttention, LlamaMLP, prepare_kernels
from pagoda.quantization.methods import quantize_linears

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input states a head reads when its config names none (vLLM's and SpecForge's
    choice: an early, a middle and a late layer)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class Eagle3Config:
    args: ModelArgs                # the head's one layer, as a Llama layer's facts
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]    # the target layers whose incoming residual stream is captured, in fc's order

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], target: ModelArgs) -> Eagle3Config:
        """The head's config.json, checked against the target it drafts for (ValueError naming the key)."""
        archs = cfg.get("architectures") or []
        if archs and not any("Eagle3" in a for a in archs):
            raise ValueError(f"architectures {archs}: not an EAGLE-3 head ({ARCHITECTURE})")
        args = ModelArgs.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                         "tie_word_embeddings": False})
        if args.vocab_size != target.vocab_size:
            raise ValueError(f"vocab_size {args.vocab_size} differs from the target's {target.vocab_size}")
        eagle = cfg.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in layers) if layers else default_aux_layers(target.num_layers)
        if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
            raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids {list(aux)}: three layers of the "
                             f"target's {target.num_layers} are needed")
        target_hidden = int(cfg.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"target_hidden_size {target_hidden} differs from the target's {target.hidden_size}")
        return cls(args, int(cfg.get("draft_vocab_size") or args.vocab_size), target_hidden, aux)

    def to_hf(self) -> dict[str, Any]:
        a = self.args
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": a.hidden_size,
                "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_heads,
                "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
                "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
                "max_position_embeddings": a.max_position_embeddings, "vocab_size": a.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
                "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                 "use_aux_hidden_state": True}}

    @classmethod
    def for_target(cls, target: ModelArgs, draft_vocab_size: int) -> Eagle3Config:
        """A new head's shape for `target` (train-eagle): the target's layer sizes, its default aux layers."""
        cfg = {"hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
               "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
               "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
               "rope_scaling": target.rope_scaling, "max_position_embeddings": target.max_position_embeddings,
               "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab_size}
        return cls.from_hf(cfg, target)


class Eagle3Head(nn.Module):
    """The head over the paged KV of its one layer; `embed` is the target's embedding unless the file has one."""

    def __init__(self, c: Eagle3Config, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        a = c.args
        self.config = c
        self.hidden_size = a.hidden_size
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        self.fc = Linear(len(c.aux_layers) * c.target_hidden_size, a.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = LlamaAttention(a, rope)
        self.self_attn.qkv_proj = Linear(2 * a.hidden_size, self.self_attn.q_size + 2 * self.self_attn.kv_size,
                                         bias=False)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = LlamaMLP(a)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = Linear(a.hidden_size, c.draft_vocab_size, bias=False)
        self.own_embed: nn.Embedding | None = None
        # Held in a tuple: assigned bare, the target's embedding would be registered as this head's own module
        # (and moved, cast and emptied with it).
        self._target_embed = (embed,)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64), persistent=False)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target_embed[0](ids) if self.own_embed is None else self.own_embed(ids)

    def forward(self, input_ids: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, from_target: bool) -> torch.Tensor:
        """One step per row: the next state [T, H] (pre-norm). `state`: the target's captured states
        [T, 3 * H_target] (`from_target`), or the head's own previous output."""
        if from_target:
            state = self.fc(state)
        emb = self.embed(input_ids).to(state.dtype)
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(state)], dim=-1)
        residual = state.clone()
        h = self.post_attention_layernorm(self.self_attn(x, positions, meta), residual)
        return self.mlp(h) + residual

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary."""
        return self.lm_head(self.norm(state)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """Its one layer's paged K and V, [num_blocks, Hkv, block_size, D] (K as words where the kernel reads
        them so), in the head's dtype."""
        a, attn = self.config.args, self.self_attn.attn
        dtype = self.norm.weight.dtype
        shape = (num_blocks, a.num_kv_heads, block_size, a.head_dim)
        attn.k_cache = torch.empty(k_cache_shape(*shape, dtype, attn.fused), dtype=dtype)
        attn.v_cache = torch.empty(shape, dtype=dtype)

def load_head(path: str | Path, target: ModelArgs, embed: Callable[[torch.Tensor], torch.Tensor],
              dtype: torch.dtype, policy: KernelPolicy, quantization: str | None = None) -> Eagle3Head:
    """Read a head folder (safetensors only: weights are never unpickled); errors are one line naming the file.
    `quantization`: the method its linears run with (speculative_config.quantization), None: `dtype`."""
    from safetensors.torch import load_file

    folder = Path(path)
    cfg_path, weights_path = folder / "config.json", folder / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise ValueError(f"speculative_config.model: {p} not found (an EAGLE-3 head is a folder with "
                             f"config.json and {WEIGHTS_FILE})")
    try:
        cfg = json.loads(cfg_path.read_text())
        c = Eagle3Config.from_hf(cfg, target)
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    try:
        tensors = load_file(weights_path)
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: one line naming it
        raise ValueError(f"{weights_path}: not a readable safetensors file ({e})") from None
    with torch.device("meta"):
        head = Eagle3Head(c, embed)
    head = head.to_empty(device="cpu")
    try:
        _load_tensors(head, tensors)
    except ValueError as e:
        raise ValueError(f"{weights_path}: {e}") from None
    head = head.to(dtype)
    head.self_attn.rope.materialize(torch.device("cpu"))  # fp32 tables, after the cast (the kernels read fp32)
    if quantization is not None:
        quantize_linears(head, quantization, head.lm_head)
    prepare_kernels(head, dtype, policy)
    return head.eval()


def _load_tensors(head: Eagle3Head, tensors: dict[str, torch.Tensor]) -> None:
    c = head.config
    names = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    attn, q, kv = head.self_attn, head.self_attn.q_size, head.self_attn.kv_size
    inter = c.args.intermediate_size
    targets: dict[str, tuple[torch.Tensor, int, int]] = {  # file name -> (parameter, first row, rows)
        "fc.weight": (head.fc.weight, 0, head.fc.weight.shape[0]),
        "midlayer.self_attn.q_proj.weight": (attn.qkv_proj.weight, 0, q),
        "midlayer.self_attn.k_proj.weight": (attn.qkv_proj.weight, q, kv),
        "midlayer.self_attn.v_proj.weight": (attn.qkv_proj.weight, q + kv, kv),
        "midlayer.self_attn.o_proj.weight": (attn.o_proj.weight, 0, attn.o_proj.weight.shape[0]),
        "midlayer.mlp.gate_proj.weight": (head.mlp.gate_up_proj.weight, 0, inter),
        "midlayer.mlp.up_proj.weight": (head.mlp.gate_up_proj.weight, inter, inter),
        "midlayer.mlp.down_proj.weight": (head.mlp.down_proj.weight, 0, head.mlp.down_proj.weight.shape[0]),
        "midlayer.input_layernorm.weight": (head.input_layernorm.weight, 0, c.args.hidden_size),
        "midlayer.hidden_norm.weight": (head.hidden_norm.weight, 0, c.args.hidden_size),
        "midlayer.post_attention_layernorm.weight": (head.post_attention_layernorm.weight, 0, c.args.hidden_size),
        "norm.weight": (head.norm.weight, 0, c.args.hidden_size),
        "lm_head.weight": (head.lm_head.weight, 0, c.draft_vocab_size),
    }
    missing = sorted(set(targets) - set(names))
    if missing:
        raise ValueError(f"missing {len(missing)} weight(s), e.g. {missing[:3]}")
    with torch.no_grad():
        for name, (param, first, rows) in targets.items():
            dst = param.data.narrow(0, first, rows)
            src = names[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight {name!r}: shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(src)
        if "d2t" in names:
            d2t = names["d2t"]
            if tuple(d2t.shape) != (c.draft_vocab_size,):
                raise ValueError(f"d2t: shape {tuple(d2t.shape)} != ({c.draft_vocab_size},)")
            head.d2t = d2t.long()
        elif c.draft_vocab_size != c.args.vocab_size:
            raise ValueError("d2t is missing, and the draft vocabulary is smaller than the target's")
        else:
            head.d2t = torch.zeros(c.draft_vocab_size, dtype=torch.int64)
        target_ids = torch.arange(c.draft_vocab_size) + head.d2t
        if int(target_ids.max()) >= c.args.vocab_size or int(target_ids.min()) < 0:
            raise ValueError("d2t maps a draft token outside the target's vocabulary")
        if "embed_tokens.weight" in names:
            emb = names["embed_tokens.weight"]
            if tuple(emb.shape) != (c.args.vocab_size, c.args.hidden_size):
                raise ValueError(f"embed_tokens.weight: shape {tuple(emb.shape)} is not "
                                 f"({c.args.vocab_size}, {c.args.hidden_size})")
            head.own_embed = nn.Embedding.from_pretrained(emb.float(), freeze=True)


def save_head(folder: str | Path, c: Eagle3Config, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (file names as in the module docstring) and the config in the published format."""
    from pagoda.quantization.checkpoint import save_tensors

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(c.to_hf(), indent=2) + "\n")
