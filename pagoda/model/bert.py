"""BERT-family encoders (BERT, MiniLM, RoBERTa, XLM-RoBERTa, MPNet) over packed variable-length sequences.

Sequences are concatenated into one [T, hidden] batch with `cu_seqlens` marking where each starts: every
matmul runs over all tokens at once, and attention is bidirectional within one sequence only (no padding, no
mask, no KV cache). RoBERTa differs from BERT only in its position ids, which start after the padding id,
and in its classification head. MPNet numbers positions as RoBERTa does, has no token-type table, and adds
to every layer's attention scores one learned bias per head and bucket of relative distance (T5's buckets),
shared by all layers. Weights load from safetensors under Hugging Face's names.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.linear import Linear

# architecture -> (family, head): the head reads the first token of each sequence into num_labels logits.
ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "RobertaModel": ("roberta", None),
    "XLMRobertaModel": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
    "MPNetModel": ("mpnet", None),
    # mpnet-base's config names its pretraining head, and models fine-tuned from it may keep that name;
    # sentence-transformers reads the encoder whatever the name says, and so does this file.
    "MPNetForMaskedLM": ("mpnet", None),
    "MPNetForSequenceClassification": ("mpnet", "roberta"),
}
_MODEL_TYPES = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel",
                "mpnet": "MPNetModel"}
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# MPNet buckets relative distances into 32 whatever relative_attention_num_buckets says (transformers passes 32
# to its bucketing), so a checkpoint's table may hold more rows than are read, never fewer.
_MPNET_BUCKETS = 32
_MPNET_MAX_DISTANCE = 128


def is_encoder_config(cfg: dict) -> bool:
    """Whether a config.json describes an encoder this file builds."""
    archs = cfg.get("architectures") or []
    return any(a in ARCHITECTURES for a in archs) or (not archs and cfg.get("model_type") in _MODEL_TYPES)


@dataclass(frozen=True)
class EncoderArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int  # 0: no token-type table (MPNet)
    layer_norm_eps: float
    hidden_act: str
    # RoBERTa numbers positions from pad_token_id + 1 (its padding position is never used by real tokens).
    position_offset: int
    relative_attention_buckets: int  # rows of MPNet's relative position bias table; 0: no bias (BERT, RoBERTa)
    head: str | None  # None: the encoder's hidden states; "bert" | "roberta": a sequence classifier
    num_labels: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> EncoderArgs:
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")]
        arch = next((a for a in archs if a in ARCHITECTURES), archs[0])
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported encoder architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        family, head = ARCHITECTURES[arch]
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        num_labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else cfg.get("num_labels", 2)
        buckets = cfg.get("relative_attention_num_buckets", _MPNET_BUCKETS) if family == "mpnet" else 0
        if family == "mpnet" and buckets < _MPNET_BUCKETS:
            raise ValueError(f"relative_attention_num_buckets {buckets}: MPNet reads {_MPNET_BUCKETS} buckets")
        # MPNet's padding position is 1 whatever pad_token_id says, so its positions start at 2.
        offset = {"roberta": cfg.get("pad_token_id", 1) + 1, "mpnet": 2}.get(family, 0)
        return cls(architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   intermediate_size=cfg["intermediate_size"],
                   max_position_embeddings=cfg["max_position_embeddings"],
                   type_vocab_size=0 if family == "mpnet" else cfg.get("type_vocab_size", 2),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_act=act, position_offset=offset,
                   relative_attention_buckets=buckets, head=head, num_labels=num_labels if head else 0)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table holds."""
        return self.max_position_embeddings - self.position_offset


def relative_position_bucket(relative: torch.Tensor, num_buckets: int = _MPNET_BUCKETS,
                             max_distance: int = _MPNET_MAX_DISTANCE) -> torch.Tensor:
    """T5's bidirectional bucket of each relative position (key - query): half the buckets for keys after the
    query; within a half, one bucket per distance below a quarter of num_buckets, then log-spaced buckets up to
    max_distance, beyond which distances share the last."""
    half = num_buckets // 2
    exact = half // 2
    distance = relative.abs()
    # The same float ops in the same order as transformers', so no distance lands on the other side of a
    # bucket boundary.
    log_bucket = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                          * (half - exact)).long()
    bucket = torch.where(distance < exact, distance, log_bucket.clamp(max=half - 1))
    return bucket + (relative > 0).long() * half


class EncoderLayer(nn.Module):
    """Post-norm transformer layer: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.num_heads, self.head_dim = a.num_heads, a.hidden_size // a.num_heads
        self.qkv = Linear(a.hidden_size, 3 * a.hidden_size)
        self.o = Linear(a.hidden_size, a.hidden_size)
        self.attn_norm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.up = Linear(a.hidden_size, a.intermediate_size)
        self.down = Linear(a.intermediate_size, a.hidden_size)
        self.mlp_norm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.act = _ACTIVATIONS[a.hidden_act]

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], bias: torch.Tensor | None = None) -> torch.Tensor:
        """`bias` [H, L, L]: added to the attention scores, a sequence of n tokens taking its top-left n x n
        (MPNet's relative position bias; None for the others)."""
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).transpose(0, 2).unbind(1)  # [H, T, D]
        attn = torch.empty(self.num_heads, t, self.head_dim, dtype=x.dtype)
        # One attention per sequence: each sees only its own tokens, and its result does not depend on what
        # else is in the batch.
        for s, e in spans:  # 4-D, so torch takes its fused CPU kernel rather than the composite one
            mask = bias[None, :, :e - s, :e - s] if bias is not None else None
            attn[:, s:e] = F.scaled_dot_product_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e],
                                                          attn_mask=mask)[0]
        x = self.attn_norm(x + self.o(attn.transpose(0, 1).reshape(t, -1)))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class ClassifierHead(nn.Module):
    """The first token's state -> dense -> tanh -> num_labels logits (BERT's pooler + classifier, and
    RoBERTa's classification head, are this same computation under different names)."""

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = Linear(a.hidden_size, a.hidden_size)
        self.out = Linear(a.hidden_size, a.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first)))


class BertEncoder(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.args = a
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size) if a.type_vocab_size else None
        self.embed_norm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(a) for _ in range(a.num_layers))
        self.relative_attention_bias = nn.Embedding(a.relative_attention_buckets, a.num_heads) \
            if a.relative_attention_buckets else None
        self.head = ClassifierHead(a) if a.head else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed sequences `input_ids` [T] (sequence i is
        cu_seqlens[i]:cu_seqlens[i + 1])."""
        spans = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        positions = torch.cat([torch.arange(e - s) for s, e in spans]) + self.args.position_offset
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embed_norm(x + self.position_embeddings(positions))
        bias = self.relative_bias(max(e - s for s, e in spans)) if self.relative_attention_bias is not None else None
        for layer in self.layers:
            x = layer(x, spans, bias)
        return x

    def relative_bias(self, n: int) -> torch.Tensor:
        """[H, n, n]: MPNet's bias on the score of query i for key j, a learned value per head for the bucket of
        j - i. It depends on j - i alone, so one table for the longest sequence serves every shorter one."""
        assert self.relative_attention_bias is not None
        pos = torch.arange(n)
        return self.relative_attention_bias(relative_position_bucket(pos[None, :] - pos[:, None])) \
            .permute(2, 0, 1).contiguous()

    def classify(self, hidden: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Logits [B, num_labels] from each sequence's first token ([CLS] or <s>)."""
        assert self.head is not None
        return self.head(hidden[torch.tensor(cu_seqlens[:-1])])


# Hugging Face's names -> this file's, applied to a weight's name after its model prefix is dropped.
_RENAMES = [
    ("embeddings.word_embeddings.", "word_embeddings."),
    ("embeddings.position_embeddings.", "position_embeddings."),
    ("embeddings.token_type_embeddings.", "token_type_embeddings."),
    ("embeddings.LayerNorm.", "embed_norm."),
    ("encoder.relative_attention_bias.", "relative_attention_bias."),  # MPNet
    ("encoder.layer.", "layers."),
    (".attention.output.dense.", ".o."),
    (".attention.output.LayerNorm.", ".attn_norm."),
    (".attention.attn.o.", ".o."),                  # MPNet's attention
    (".attention.LayerNorm.", ".attn_norm."),
    (".intermediate.dense.", ".up."),
    (".output.dense.", ".down."),
    (".output.LayerNorm.", ".mlp_norm."),
    ("pooler.dense.", "head.dense."),           # BERT's classifier reads its pooler
    ("classifier.dense.", "head.dense."),       # RoBERTa's head
    ("classifier.out_proj.", "head.out."),
    ("classifier.", "head.out."),
]
# A projection's name -> its place in the fused qkv weight.
_QKV = {".attention.self.query.": 0, ".attention.self.key.": 1, ".attention.self.value.": 2,
        ".attention.attn.q.": 0, ".attention.attn.k.": 1, ".attention.attn.v.": 2}  # MPNet
_PREFIXES = ("bert.", "roberta.", "mpnet.", "model.")


def _weights_file(folder: str) -> str:
    path = os.path.join(folder, "model.safetensors")
    if os.path.isfile(path):
        return path
    for name in ("pytorch_model.bin", "model.pt"):
        if os.path.isfile(os.path.join(folder, name)):
            raise ValueError(f"{os.path.join(folder, name)}: pickled weights are not loaded (they can run code); "
                             "convert the model to model.safetensors")
    raise FileNotFoundError(f"no model.safetensors in {folder}")


def load_encoder(folder: str, dtype: torch.dtype = torch.float32, policy: KernelPolicy | None = None) -> BertEncoder:
    """Build the encoder of an HF folder (config.json + model.safetensors) and load its weights; its Linears run
    the engine's kernels under `policy` (the panel GEMMs, AMX tiles for bf16 where the CPU has them; None: the
    C++ kernels where they load), the same at every token count."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        args = EncoderArgs.from_hf_config(json.load(f))
    with torch.device("meta"):
        model = BertEncoder(args)
    state: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    for name, tensor in load_file(_weights_file(folder)).items():
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.endswith("position_ids") or name.startswith("lm_head.") or \
                (args.head is None and name.startswith(("pooler.", "classifier."))):
            continue  # a buffer of arange, and heads an embedding model does not use
        for part, i in _QKV.items():
            if part in name:
                layer, _, kind = name.partition(part)
                qkv.setdefault((layer, kind), [None, None, None])[i] = tensor
                break
        else:
            for old, new in _RENAMES:  # in order: a renamed part never matches a later rule
                name = name.replace(old, new, 1)
            state[name] = tensor
    for (layer, kind), parts in qkv.items():
        if any(p is None for p in parts):
            raise ValueError(f"{folder}: {layer} lacks one of query/key/value {kind}")
        state[f"{layer.replace('encoder.layer.', 'layers.')}.qkv.{kind}"] = torch.cat(parts)  # type: ignore[arg-type]
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match {args.architecture}: missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    policy = policy if policy is not None else KernelPolicy.resolve()
    for m in model.modules():
        if isinstance(m, Linear):
            m.prepare(dtype, policy)
    return model.eval()
