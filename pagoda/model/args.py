"""ModelArgs: the architecture facts the model code needs, read from an HF config.json dict."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagoda.layers.moe import GroupedRouting


@dataclass
class MoeArgs:
    """A sparse MLP's facts (Mixtral, Qwen3-MoE): each token runs `top_k` of `num_experts` expert MLPs."""

    num_experts: int
    top_k: int
    intermediate_size: int     # each expert's (ModelArgs.intermediate_size is a dense layer's)
    renormalize: bool          # the k routing weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    round_weights: bool        # routing weights rounded to the activations' dtype before scaling (Qwen3-MoE)
    sparse_layers: list[bool]  # per layer: a MoE block, or a dense MLP (Qwen3-MoE's mlp_only_layers, sparse step)
    # GLM-4.5 (DeepSeek-V3's router): sigmoid scores plus a per-expert bias choose the experts within the best
    # groups, and the chosen scores (renormalized) are scaled; None: softmax routing (Mixtral, Qwen3-MoE).
    grouped: GroupedRouting | None = None
    shared_intermediate: int = 0  # the shared experts' MLP every token runs beside its routed ones (0: none)


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    moe: MoeArgs | None = None  # sparse MLPs (Mixtral, Qwen3-MoE); None for dense models
    # Each layer's sliding window: a query at p attends to keys (p - w, p]; 0 for a layer that sees every key.
    layer_windows: list[int] = field(default_factory=list)
    partial_rotary_factor: float = 1.0  # the share of each head that RoPE rotates (Phi-4-mini: 0.75)
    # Multi-token prediction layers stored after the decoder layers (GLM-4.5's num_nextn_predict_layers): the
    # target skips them; speculative decoding's method "mtp" drafts with the first (spec_decode/mtp.py).
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Read and check an HF config dict; a missing key or a bad value raises ValueError naming it."""
        archs = cfg.get("architectures") or []
        if not archs:
            mt = cfg.get("model_type", "")
            archs = {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                     "mistral": ["MistralForCausalLM"], "phi3": ["Phi3ForCausalLM"],
                     "mixtral": ["MixtralForCausalLM"], "qwen3_moe": ["Qwen3MoeForCausalLM"],
                     "gemma2": ["Gemma2ForCausalLM"], "gemma3_text": ["Gemma3ForCausalLM"],
                     "glm4_moe": ["Glm4MoeForCausalLM"]}.get(mt, [])
        if not archs:
            raise ValueError("config.json has neither 'architectures' nor a known 'model_type'")
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing and isinstance(cfg.get("text_config"), dict):  # Gemma3ForConditionalGeneration, Llava, ...
            raise ValueError(f"unsupported architecture {archs[0]!r}: a multimodal model (its language model's "
                             "config is under text_config); Pagoda runs text-only checkpoints")
        if missing:
            raise ValueError(f"missing {missing[0]!r} in config.json")
        hidden = _size(cfg, "hidden_size")
        heads = _size(cfg, "num_attention_heads")
        kv_heads = _size(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(f"bad config value: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ValueError(f"bad config value: hidden_size ({hidden}) is not divisible by "
                             f"num_attention_heads ({heads}), and there is no head_dim")
        head_dim = _size(cfg, "head_dim", hidden // heads)
        if head_dim % 2:
            raise ValueError(f"bad config value: head_dim {head_dim} is odd (rotary embedding needs pairs)")
        arch = archs[0]
        try:
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta/scaling here
            if isinstance(rope_params, dict) and isinstance(rope_params.get("full_attention"), dict):
                rope_params = rope_params["full_attention"]  # one per layer type (Gemma 3): the global layers'
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            partial = 1.0
            if arch in _PARTIAL_ROTARY:  # the Llama family ignores partial_rotary_factor; Phi3 and GLM read it
                rp = rope_params if isinstance(rope_params, dict) else {}
                partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor")
                                       or _PARTIAL_ROTARY[arch]))
            if arch == "Phi3ForCausalLM" and isinstance(rope_scaling, dict):
                rope_scaling = _phi3_rope_scaling(cfg, rope_scaling)
            args = cls(
                architecture=arch,
                vocab_size=_size(cfg, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_size(cfg, "intermediate_size"),
                num_layers=_size(cfg, "num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if arch in _GEMMA else 1e-5)),
                rope_theta=float(rope_theta or (1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0)),
                rope_scaling=rope_scaling,
                max_position_embeddings=_size(cfg, "max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
                or (arch == "Glm4MoeForCausalLM" and bool(cfg.get("use_qk_norm"))),
                partial_rotary_factor=partial,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                layer_windows=_layer_windows(cfg, arch),
                moe=_moe_args(cfg, arch),
                num_mtp_layers=_count(cfg, "num_nextn_predict_layers") if arch in _MTP_ARCHS else 0,
                hf_config=cfg,
            )
        except (TypeError, ValueError) as e:  # a list where a number belongs, a non-numeric string
            raise ValueError(f"bad config value ({e})") from None
        if not (math.isfinite(args.rope_theta) and args.rope_theta > 0):
            raise ValueError(f"bad config value: rope_theta = {args.rope_theta} (must be positive)")
        if not (math.isfinite(args.rms_norm_eps) and args.rms_norm_eps >= 0):
            raise ValueError(f"bad config value: rms_norm_eps = {args.rms_norm_eps} (must be >= 0)")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ValueError(f"bad config value: rope_scaling = {rope_scaling!r} (must be an object)")
        if not (0 < args.partial_rotary_factor <= 1 and args.rotary_dim >= 2 and args.rotary_dim % 2 == 0):
            raise ValueError(f"bad config value: partial_rotary_factor = {args.partial_rotary_factor} (must rotate "
                             f"an even number >= 2 of the head's {head_dim} dims)")
        return args

    def __post_init__(self) -> None:
        if not self.layer_windows:  # built by hand (tests, tools): every layer global
            self.layer_windows = [0] * self.num_layers

    @property
    def kv_window(self) -> int | None:
        """The window when every layer has the same one (the KV manager may then free blocks behind it);
        None when some layer reads the whole context."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and 0 not in windows else None

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates: int(head_dim * factor) as in transformers, with a
        margin for a factor read back as rotary dims / head_dim (a GGUF's rope.dimension_count)."""
        return int(self.head_dim * self.partial_rotary_factor + 1e-6)


def _phi3_rope_scaling(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's rope_scaling as transformers' Phi3Config reads it: "su" and "yarn" are LongRoPE, and the top-level
    original_max_position_embeddings (Phi3Config's default 4096) overrides the dict's."""
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("su", "yarn", "longrope"):
        scaling["rope_type"] = scaling["type"] = "longrope"
        scaling["original_max_position_embeddings"] = int(cfg.get("original_max_position_embeddings") or 4096)
    return scaling


def _layer_windows(cfg: dict[str, Any], arch: str) -> list[int]:
    """Per layer, its sliding window or 0, as transformers applies `sliding_window`: to the layers `layer_types`
    marks "sliding_attention" (Qwen2/Qwen3 build it from use_sliding_window and max_window_layers), and to every
    layer of Mistral and Phi-3 when it is set. Gemma configs without `layer_types` follow their pattern: Gemma 2
    alternates sliding and global from layer 0, Gemma 3 has `sliding_window_pattern` - 1 sliding layers (5 by
    default) before each global one."""
    layers = _size(cfg, "num_hidden_layers")
    window = cfg.get("sliding_window", 4096 if arch in _GEMMA else None)  # Gemma's configs default to 4096
    if window is None:
        return [0] * layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"bad config value: sliding_window = {window!r} (must be a positive integer or null)")
    types = cfg.get("layer_types")
    if types is None and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(cfg.get("max_window_layers") or 0) if cfg.get("use_sliding_window") else layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None and arch in _GEMMA:
        period = 2 if arch == "Gemma2ForCausalLM" else _size(cfg, "sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    if types is None and arch == "Qwen3MoeForCausalLM":  # its config drops the window unless use_sliding_window
        return [window if cfg.get("use_sliding_window") else 0] * layers
    if types is None:
        return [window if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM") else 0] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"bad config value: layer_types must list one type per layer ({layers})")
    return [window if t == "sliding_attention" else 0 for t in types]


_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # (1 + w) norms, tied embeddings by default (model/gemma.py)
# Architectures whose config's partial_rotary_factor applies, with transformers' default for each.
_PARTIAL_ROTARY = {"Phi3ForCausalLM": 1.0, "Glm4MoeForCausalLM": 0.5}
_MTP_ARCHS = ("Glm4MoeForCausalLM",)  # checkpoints that may carry MTP layers (ModelArgs.num_mtp_layers)

_REQUIRED = ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers")

# Upper bounds far beyond any model of the supported families (Llama 3.1 405B: hidden 16384, 126
# layers, vocab 128256): a config past them is corrupt, and is refused before anything it sizes is
# allocated. max_position_embeddings sizes the rotary cos/sin tables.
_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
           "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
           "head_dim": 1024, "max_position_embeddings": 1 << 20, "sliding_window_pattern": 1024,
           # MoE (Mixtral, Qwen3-MoE): DeepSeek-V3 has 256 experts, Qwen3-235B-A22B 128.
           "num_local_experts": 1024, "num_experts": 1024, "num_experts_per_tok": 1024, "decoder_sparse_step": 1024,
           "moe_intermediate_size": 1 << 18, "n_routed_experts": 1024, "n_group": 1024, "topk_group": 1024,
           # GLM-4.5: dense layers before the first sparse one, shared experts, MTP layers (each may be 0).
           "first_k_dense_replace": 1024, "n_shared_experts": 64, "num_nextn_predict_layers": 16}


def _size(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """cfg[key] as a positive integer within _LIMITS; `default` when the key is absent or null."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _LIMITS[key]:
        raise ValueError(f"bad config value: {key} = {value!r} (must be an integer in 1..{_LIMITS[key]})")
    return value


def _count(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    """cfg[key] as an integer in 0.._LIMITS[key] (`default` when absent or null)."""
    value = cfg.get(key)
    return default if value is None else (0 if value == 0 else _size(cfg, key))


def _moe_args(cfg: dict[str, Any], arch: str) -> MoeArgs | None:
    """The MoE facts of a Mixtral or Qwen3-MoE config, with transformers' defaults for absent keys; None for other
    architectures. Qwen3-MoE's layer i is sparse unless mlp_only_layers lists it, when i + 1 is a multiple of
    decoder_sparse_step (and there are experts at all)."""
    layers = _size(cfg, "num_hidden_layers")
    # Hub configs name the count num_local_experts (Mixtral) or num_experts (Qwen3-MoE); transformers 5 writes
    # num_local_experts for both (an attribute alias).
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    if arch == "MixtralForCausalLM":
        experts = _size(cfg, key, 8)
        return MoeArgs(experts, _top_k(cfg, experts, 2), _size(cfg, "intermediate_size"), True, False,
                       [True] * layers)
    if arch == "Glm4MoeForCausalLM":
        return _glm4_moe_args(cfg, layers)
    if arch != "Qwen3MoeForCausalLM":
        return None
    experts = 0 if cfg.get(key) == 0 else _size(cfg, key, 128)
    step = _size(cfg, "decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ValueError(f"bad config value: mlp_only_layers = {dense!r} (must be a list of layer indices)")
    sparse = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)]
    top_k = _top_k(cfg, experts, 8) if any(sparse) else 0
    return MoeArgs(experts, top_k, _size(cfg, "moe_intermediate_size", 768), bool(cfg.get("norm_topk_prob", False)),
                   True, sparse)


def _glm4_moe_args(cfg: dict[str, Any], layers: int) -> MoeArgs:
    """GLM-4.5's MoE facts with transformers' Glm4MoeConfig defaults: layers from first_k_dense_replace on are
    sparse; n_routed_experts in n_group groups, of which topk_group are searched; n_shared_experts shared ones
    of moe_intermediate_size each."""
    experts = _size(cfg, "n_routed_experts", 128)
    groups, searched = _size(cfg, "n_group", 1), _size(cfg, "topk_group", 1)
    if experts % groups or searched > groups:
        raise ValueError(f"bad config value: n_group = {groups}, topk_group = {searched} (the {experts} experts "
                         "must split into n_group equal groups, of which topk_group are searched)")
    top_k = _top_k(cfg, experts, 8)
    if top_k > searched * (experts // groups):
        raise ValueError(f"bad config value: num_experts_per_tok = {top_k} (more than the topk_group groups hold)")
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"bad config value: routed_scaling_factor = {scale} (must be positive)")
    inter = _size(cfg, "moe_intermediate_size", 1408)
    first = _count(cfg, "first_k_dense_replace", 1)
    return MoeArgs(experts, top_k, inter, bool(cfg.get("norm_topk_prob", True)), False,
                   [i >= first for i in range(layers)], GroupedRouting(groups, searched, scale),
                   inter * _count(cfg, "n_shared_experts", 1))


def _top_k(cfg: dict[str, Any], experts: int, default: int) -> int:
    top_k = _size(cfg, "num_experts_per_tok", default)
    if top_k > experts:
        raise ValueError(f"bad config value: num_experts_per_tok = {top_k} (more than the {experts} experts)")
    return top_k

