"""Read GGUF checkpoints: metadata -> HF-style config dict, tensors -> HF-named torch weights.

The header is parsed by a small reader of our own instead of `gguf.GGUFReader`: GGUFReader
builds a numpy memmap view per element of every metadata array, which costs ~2 s for the
98k token/merge strings of even a tiny model. Here string arrays are skipped (only their
length is kept) and the header parses in tens of milliseconds. Tensor data is memory-mapped
and dequantized with `gguf.quants.dequantize`, so the numerics are gguf-py's.
"""
from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda.cpus import affinity
from pagoda.model.errors import ModelFileError, warn_nonfinite

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec).
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
             6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_T_STRING, _T_ARRAY = 8, 9
# String arrays longer than this (token lists, merges) are not materialized.
_MAX_KEPT_STRINGS = 4096
_MAX_DIMS = 4          # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 4   # nested metadata arrays: real files use none; bounded so a corrupt one cannot recurse

# GGUF architecture -> (HF architectures entry, HF model_type).
SUPPORTED_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                   "qwen3": ("Qwen3ForCausalLM", "qwen3"), "phi3": ("Phi3ForCausalLM", "phi3"),
                   "gemma2": ("Gemma2ForCausalLM", "gemma2"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


class SkippedStrings:
    """Placeholder for a long string array whose contents were not read (len() still works)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"SkippedStrings({self.count})"


@dataclass
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]   # GGUF order: dims[0] is the fastest-varying (row length)
    qtype: int              # gguf.GGMLQuantizationType value
    offset: int             # absolute byte offset in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (numpy/torch) shape: reversed GGUF dims."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """Parsed GGUF header (metadata + tensor directory); tensor data stays on disk (memmap).

    Every count, length and offset is checked against the file's size as it is read, so a corrupt or
    truncated file raises ModelFileError at once instead of looping, allocating or reading past the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        with open(path, "rb") as f:
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise ModelFileError(path, f"not a GGUF file ({e})") from None
        try:
            self._parse(buf)
        except (struct.error, OverflowError) as e:
            raise ModelFileError(path, f"truncated or corrupt GGUF header ({e})") from None
        finally:
            buf.close()
        # Mapped up front (cheap) so dequantization threads never race to create it.
        self._data: np.memmap = np.memmap(path, dtype=np.uint8, mode="r")

    def __reduce__(self) -> tuple[type[GGUFFile], tuple[str]]:
        # Sent to another process (a tensor-parallel rank) as its path: pickling the memmap would copy the file.
        return GGUFFile, (self.path,)

    # -- header parsing ---------------------------------------------------------------
    def _need(self, buf: mmap.mmap, off: int, nbytes: int, what: str) -> None:
        if nbytes < 0 or off + nbytes > len(buf):
            raise ModelFileError(self.path, f"truncated or corrupt GGUF header: {what} at byte {off} needs "
                                            f"{nbytes} bytes, past the end of the {len(buf)}-byte file")

    def _parse(self, buf: mmap.mmap) -> None:
        if buf[:4] != GGUF_MAGIC:
            raise ModelFileError(self.path, f"not a GGUF file (bad magic {bytes(buf[:4])!r})")
        self._need(buf, 0, 24, "the GGUF preamble")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            # v1 used 32-bit counts; a huge value means a big-endian file. Neither is supported.
            raise ModelFileError(self.path, f"unsupported GGUF version {version} (need 2 or 3, little-endian)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        # A metadata entry takes at least 13 bytes (key length, type, a 1-byte value), a tensor entry 24.
        if 13 * n_kv + 24 * n_tensors > len(buf) - 24:
            raise ModelFileError(self.path, f"truncated or corrupt GGUF header: it claims {n_kv} metadata entries and "
                                            f"{n_tensors} tensors, more than the {len(buf)}-byte file holds")
        off = 24
        for _ in range(n_kv):
            key, off = self._read_str(buf, off)
            self._need(buf, off, 4, f"the type of metadata {key!r}")
            (vtype,) = struct.unpack_from("<I", buf, off)
            value, off = self._read_value(buf, off + 4, vtype, key)
            self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name, off = self._read_str(buf, off)
            self._need(buf, off, 4, f"tensor {name!r}")
            (n_dims,) = struct.unpack_from("<I", buf, off)
            if n_dims > _MAX_DIMS:
                raise ModelFileError(self.path, f"corrupt GGUF header: tensor {name!r} has {n_dims} dimensions "
                                                f"(at most {_MAX_DIMS})")
            self._need(buf, off, 16 + 8 * n_dims, f"tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            qtype, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name, tuple(int(d) for d in dims), int(qtype), int(rel)))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align <= 0:
            raise ModelFileError(self.path, f"corrupt GGUF header: general.alignment = {align!r}")
        data_start = (off + align - 1) // align * align
        for name, dims, qtype, rel in infos:
            info = GGUFTensorInfo(name, dims, qtype, data_start + rel)
            end = info.offset + self._nbytes(info)
            if end > len(buf):
                raise ModelFileError(self.path, f"truncated or corrupt: tensor {name} {info.shape} ends at byte {end}, "
                                                f"past the end of the {len(buf)}-byte file")
            self.tensors[name] = info

    def _nbytes(self, info: GGUFTensorInfo) -> int:
        """Stored size of a tensor; ModelFileError for a type pagoda cannot dequantize or a ragged row."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(info.qtype)
        except ValueError:
            raise ModelFileError(self.path, f"unsupported tensor type {info.qtype} for tensor {info.name}") from None
        if qtype not in GGML_QUANT_SIZES or not _dequantizable(qtype):
            raise ModelFileError(self.path, f"unsupported tensor type {qtype.name} for tensor {info.name}")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row = info.dims[0] if info.dims else 1
        if row % block_size:
            raise ModelFileError(self.path, f"corrupt GGUF header: tensor {info.name} has rows of {row} values, "
                                            f"not a multiple of {qtype.name}'s block of {block_size}")
        n_rows = math.prod(info.dims[1:])
        return n_rows * (row // block_size) * type_size

    def _read_str(self, buf: mmap.mmap, off: int) -> tuple[str, int]:
        self._need(buf, off, 8, "a string length")
        (n,) = struct.unpack_from("<Q", buf, off)
        self._need(buf, off + 8, n, f"a string of length {n}")
        return buf[off + 8: off + 8 + n].decode("utf-8", errors="replace"), off + 8 + n

    def _read_value(self, buf: mmap.mmap, off: int, vtype: int, key: str, depth: int = 0) -> tuple[Any, int]:
        if vtype == _T_STRING:
            return self._read_str(buf, off)
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            self._need(buf, off, struct.calcsize(fmt), f"metadata {key!r}")
            return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
        if vtype == _T_ARRAY and depth < _MAX_ARRAY_DEPTH:
            self._need(buf, off, 12, f"metadata {key!r}")
            etype, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if etype == _T_STRING:
                self._need(buf, off, 8 * count, f"the {count} strings of metadata {key!r}")
                if count > _MAX_KEPT_STRINGS:
                    for _ in range(count):  # skip: only the length is needed (vocab size)
                        self._need(buf, off, 8, f"a string of metadata {key!r}")
                        off += 8 + struct.unpack_from("<Q", buf, off)[0]
                    self._need(buf, off, 0, f"the strings of metadata {key!r}")
                    return SkippedStrings(count), off
                items = []
                for _ in range(count):
                    s, off = self._read_str(buf, off)
                    items.append(s)
                return items, off
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype])
                self._need(buf, off, dt.itemsize * count, f"the {count} values of metadata {key!r}")
                arr = np.frombuffer(buf, dtype=dt, count=count, offset=off).copy()
                return (arr.tolist() if count <= _MAX_KEPT_STRINGS else arr), off + dt.itemsize * count
            if etype == _T_ARRAY:  # nested arrays: rare, parse generically
                self._need(buf, off, 12 * count, f"the {count} arrays of metadata {key!r}")
                items = []
                for _ in range(count):
                    v, off = self._read_value(buf, off, _T_ARRAY, key, depth + 1)
                    items.append(v)
                return items, off
            vtype = etype
        raise ModelFileError(self.path, f"corrupt GGUF header: metadata {key!r} has unknown value type {vtype}")

    # -- accessors ----------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(self.path, "GGUF metadata lacks general.architecture")
        return arch

    def raw_tensor(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, shaped the way gguf.quants.dequantize expects."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
        row_bytes = info.dims[0] // block_size * type_size  # whole blocks, within the file: checked at parse
        raw = self._data[info.offset: info.offset + self._nbytes(info)]
        return raw.reshape(*info.shape[:-1], row_bytes)

    def dequantized(self, name: str) -> np.ndarray:
        """float32 numpy array (logical shape) of a tensor."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        out = dequantize(self.raw_tensor(name), GGMLQuantizationType(info.qtype))
        return out.reshape(info.shape)


def _dequantizable(qtype: Any) -> bool:
    """Whether gguf.quants.dequantize handles `qtype` (F32, F16 and its table of block formats)."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    traits = getattr(quants, "_type_traits", None)
    if traits is None:  # another gguf-py layout: leave the verdict to dequantize itself
        return True
    return qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qtype in traits


def _meta(g: GGUFFile, key: str, default: Any = None) -> Any:
    return g.fields.get(f"{g.architecture}.{key}", default)


def _field_int(g: GGUFFile, key: str, default: int | None = None) -> int | None:
    """An integer metadata value (`default` when absent); ModelFileError naming the key when it is not one."""
    value = g.fields.get(key)
    if value is None:
        return default
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise ModelFileError(g.path, f"bad GGUF metadata: {key} = {value!r} (not an integer)")


def _meta_int(g: GGUFFile, key: str, default: int | None = None) -> int | None:
    return _field_int(g, f"{g.architecture}.{key}", default)


def _meta_float(g: GGUFFile, key: str, default: float) -> float:
    value = _meta(g, key, default)
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    raise ModelFileError(g.path, f"bad GGUF metadata: {g.architecture}.{key} = {value!r} (not a number)")


def gguf_hf_config(g: GGUFFile) -> dict[str, Any]:
    """Build an HF config.json-style dict from GGUF metadata."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(g.path, f"unsupported GGUF architecture {arch!r} "
                                     f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    hf_arch, model_type = SUPPORTED_ARCHS[arch]
    required = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads"}
    missing = [f"{arch}.{k}" for k in required if _meta(g, k) is None]
    if missing:
        raise ModelFileError(g.path, f"GGUF metadata lacks {', '.join(missing)}")
    hidden = _meta_int(g, "embedding_length")
    heads = _meta_int(g, "attention.head_count")
    kv_heads = _meta_int(g, "attention.head_count_kv", heads)
    # Zero heads: leave head_dim to ModelArgs, which refuses the head count with a clear message.
    head_dim = _meta_int(g, "attention.key_length") or (hidden // heads if hidden and heads else None)

    vocab = _meta_int(g, "vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in g.fields:
        vocab = len(g.fields["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in g.tensors:
        vocab = g.tensors["token_embd.weight"].shape[0]
    if vocab is None:
        raise ModelFileError(g.path, "cannot determine the vocab size from the GGUF metadata")

    qwen = arch in ("qwen2", "qwen3")
    default_theta = 1_000_000.0 if qwen else 10_000.0
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _meta_int(g, "block_count"),
        "intermediate_size": _meta_int(g, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "rms_norm_eps": _meta_float(g, "attention.layer_norm_rms_epsilon", 1e-6 if qwen else 1e-5),
        "rope_theta": _meta_float(g, "rope.freq_base", default_theta),
        "rope_scaling": None,
        "max_position_embeddings": _meta_int(g, "context_length", 2048),
        # llama.cpp omits output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": arch == "qwen2",
        "torch_dtype": "float32",
    }
    scaling_type = _meta(g, "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rs: dict[str, Any] = {"rope_type": scaling_type, "type": scaling_type,
                              "factor": _meta_float(g, "rope.scaling.factor", 1.0)}
        orig = _meta_int(g, "rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = orig
        cfg["rope_scaling"] = rs
    if arch == "phi3":
        _phi3_attention(g, cfg)
    _moe_config(g, cfg)
    if arch in _GEMMA_NORM_PLUS_ONE:
        _gemma_config(g, cfg)
    eos = _field_int(g, "tokenizer.ggml.eos_token_id")
    eot = _field_int(g, "tokenizer.ggml.eot_token_id")
    cfg["bos_token_id"] = _field_int(g, "tokenizer.ggml.bos_token_id")
    cfg["eos_token_id"] = [eos, eot] if eos is not None and eot is not None and eot != eos else eos
    pad = _field_int(g, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = pad
    return cfg


def _phi3_attention(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """Phi-3's attention facts as llama.cpp's converter writes them: rope.dimension_count (partial rotary), the
    pretraining context as rope.scaling.original_context_length, LongRoPE's per-frequency factors as the tensors
    rope_factors_short/long (no rope.scaling.type) with the attention factor as rope.scaling.attn_factor, and
    attention.sliding_window."""
    window = _meta_int(g, "attention.sliding_window")
    if window:  # Phi-3-mini-4k's 2047; 0 marks none (Phi-4)
        cfg["sliding_window"] = window
    rot = _meta_int(g, "rope.dimension_count")
    if rot is not None and cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rot / cfg["head_dim"]
    orig = _meta_int(g, "rope.scaling.original_context_length")
    if orig is not None:
        cfg["original_max_position_embeddings"] = orig
    present = [n for n in _PHI3_ROPE_FACTORS.values() if n in g.tensors]
    if not present:
        return  # Phi-3-mini-4k: plain RoPE
    if len(present) < 2:
        raise ModelFileError(g.path, f"GGUF has {present[0]} without its pair "
                                     f"({' and '.join(_PHI3_ROPE_FACTORS.values())} come together)")
    # original_max_position_embeddings reaches the dict from the top level, as for an HF config (ModelArgs).
    rs: dict[str, Any] = {"rope_type": "longrope", "type": "longrope"}
    for key, name in _PHI3_ROPE_FACTORS.items():
        rs[key] = [float(f) for f in g.dequantized(name).reshape(-1)]
    if _meta(g, "rope.scaling.attn_factor") is not None:
        rs["attention_factor"] = _meta_float(g, "rope.scaling.attn_factor", 1.0)
    cfg["rope_scaling"] = rs


_PHI3_ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}


def _gemma_config(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """Gemma's facts as llama.cpp's converter writes them and its loader reads them: attention.sliding_window;
    the layer pattern, which llama.cpp fixes (Gemma 2: every other layer sliding from layer 0; Gemma 3: five
    sliding to one global) unless attention.sliding_window_pattern gives it (a period, or a flag per layer);
    the soft-caps (Gemma 2's default to 50 and 30, as in llama.cpp and transformers); Gemma 3's local RoPE base
    (rope.freq_base_swa, else llama.cpp's 10000). The attention scale is not stored: llama.cpp takes
    head_dim ** -0.5, and (hidden / heads) ** -0.5 for the 27B models (46 and 62 layers), as Google's configs."""
    arch, layers = g.architecture, cfg["num_hidden_layers"]
    pattern = _meta(g, "attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        period = _meta_int(g, "attention.sliding_window_pattern") or (2 if arch == "gemma2" else 6)
        sliding = [bool((i + 1) % period) for i in range(layers)]
    cfg["sliding_window"] = _meta_int(g, "attention.sliding_window") or None  # None: every layer global
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    for key, gemma2_default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        absent = gemma2_default if arch == "gemma2" else None
        cfg[key] = absent if _meta(g, key) is None else _meta_float(g, key, 0.0)
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62)) and cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = _meta_float(g, "rope.freq_base_swa", 10_000.0)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"


# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its kernels scale by the weight alone); the HF
# stream carries transformers' w, which model/gemma.py folds back into 1 + w.
_GEMMA_NORM_PLUS_ONE = ("gemma2", "gemma3")


def stored_offset(arch: str, name: str) -> float:
    """What llama.cpp's converter added to GGUF tensor `name` of `arch`: 1 for a Gemma norm weight, else 0."""
    return 1.0 if arch in _GEMMA_NORM_PLUS_ONE and name.endswith("norm.weight") else 0.0

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3's per-head norms
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q|k|v in one matrix, as in its HF checkpoint
}
# Where an arch gives a name another meaning: llama.cpp's Phi-3 stores gate|up fused under ffn_up.
# Gemma's four norms a layer: ffn_norm is the pre-feed-forward one, post_attention_norm and post_ffw_norm follow
# the attention and the MLP.
_GEMMA_LAYER_MAP = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_MAP = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_LAYER_MAP, "gemma3": _GEMMA_LAYER_MAP}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that carry no HF parameter (llama3 rope frequencies and Phi-3's LongRoPE factors are folded into
# the rope config).
IGNORED_TENSORS = {"rope_freqs.weight", *_PHI3_ROPE_FACTORS.values()}

# Mixture of experts as llama.cpp lays it out: the router as ffn_gate_inp, and a layer's experts stacked into one
# tensor per projection, [E, rows, cols], whose HF name holds "{e}" for the expert's index (split_experts). Mixtral
# is arch llama with llama.expert_count; Qwen3-MoE is qwen3moe.
SUPPORTED_ARCHS["qwen3moe"] = ("Qwen3MoeForCausalLM", "qwen3_moe")
_ARCH_LAYER_MAP["llama"] = {
    "ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3", "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"}
_ARCH_LAYER_MAP["qwen3moe"] = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj"}


def _moe_config(g: GGUFFile, cfg: dict[str, Any]) -> None:
    """The experts of a Mixtral (arch llama) or Qwen3-MoE GGUF, as llama.cpp's converter writes them: expert_count,
    expert_used_count and (Qwen3-MoE) expert_feed_forward_length. llama.cpp renormalizes both models' top-k
    weights (Qwen3-MoE's norm_topk_prob) and has no dense layers among Qwen3-MoE's."""
    experts = _meta_int(g, "expert_count", 0)
    if not experts:
        return
    used = _meta_int(g, "expert_used_count")
    if g.architecture == "llama":
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                   num_experts_per_tok=used)
    elif g.architecture == "qwen3moe":
        ff = _meta_int(g, "expert_feed_forward_length")
        if ff is None:
            raise ModelFileError(g.path, "GGUF metadata lacks qwen3moe.expert_feed_forward_length")
        cfg.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=ff, norm_topk_prob=True,
                   rope_theta=_meta_float(g, "rope.freq_base", 1_000_000.0),
                   rms_norm_eps=_meta_float(g, "attention.layer_norm_rms_epsilon", 1e-6))


def per_expert(hf: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of each weight a GGUF tensor holds: one per expert of stacked experts [E, ...] (an "{e}"
    in `hf`), else the tensor itself."""
    if "{e}" not in hf:
        return [(hf, shape)]
    return [(hf.format(e=e), shape[1:]) for e in range(shape[0])]


def split_experts(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A GGUF's weight stream with each stacked experts tensor [E, ...] split into its experts' HF weights."""
    for hf, t in weights:
        if "{e}" in hf:
            yield from ((hf.format(e=e), t[e]) for e in range(t.shape[0]))
        else:
            yield hf, t


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name of architecture `arch`; None when there is no equivalent."""
    m = _BLK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = _ARCH_LAYER_MAP.get(arch, {}).get(part) or _LAYER_MAP.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    stem, _, kind = name.rpartition(".")
    hf = _TOP_MAP.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def hf_to_gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for HF parameter `hf_name` of a dense model of architecture `arch` (the inverse of
    gguf_to_hf_name, from the same tables); None when it has none."""
    stem, _, kind = hf_name.rpartition(".")
    top = {hf: g for g, hf in _TOP_MAP.items()}
    if stem in top:
        return f"{top[stem]}.{kind}"
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", stem)
    if m is None:
        return None
    layer_map = {**_LAYER_MAP, **_ARCH_LAYER_MAP.get(arch, {})}
    part = next((g for g, hf in layer_map.items() if hf == m.group(2)), None)
    return None if part is None else f"blk.{m.group(1)}.{part}.{kind}"


def hf_tensor_names(g: GGUFFile) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name for every tensor that loads; ModelFileError for one with none."""
    names = {}
    for name in g.tensors:
        if name in IGNORED_TENSORS:
            continue
        hf = gguf_to_hf_name(name, g.architecture)
        if hf is None:
            raise ModelFileError(g.path, f"GGUF tensor {name!r} has no known HF equivalent "
                                         f"for arch {g.architecture!r}")
        names[name] = hf
    return names


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (weight or bias).

    The converter regroups each head's rows from HF's rotate-half layout [first half; second
    half] into interleaved pairs (row 2i from the first half, 2i+1 from the second). Viewing
    rows as (head, pair, 2) and swapping the last two axes restores the HF order.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row permutation of an HF Q or K projection (weight or bias): the inverse of
    unpermute_qk, as its converter applies it to Llama-architecture checkpoints."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, dim, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(g: GGUFFile, hf_config: dict[str, Any], dtype: torch.dtype,
                      num_threads: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every parameter in the GGUF file, dequantized to `dtype`."""
    arch = g.architecture
    permute = arch == "llama"  # qwen2's converter keeps the HF row layout
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    jobs = list(hf_tensor_names(g).items())
    for name in sorted(g.tensors.keys() & IGNORED_TENSORS):
        logger.info("ignoring GGUF tensor %s", name)

    def load(job: tuple[str, str]) -> tuple[str, torch.Tensor]:
        name, hf = job
        arr = g.dequantized(name)
        offset = stored_offset(arch, name)
        if offset:
            arr = np.asarray(arr, dtype=np.float32) - offset
        if permute and ".attn_q." in name:
            arr = unpermute_qk(arr, heads)
        elif permute and ".attn_k." in name:
            arr = unpermute_qk(arr, kv_heads)
        # F32/F16 tensors come back as views of the read-only memmap: torch needs owned memory.
        arr = arr.copy() if not arr.flags.writeable else np.ascontiguousarray(arr)
        t = torch.from_numpy(arr)
        t = t if t.dtype == dtype else t.to(dtype)
        warn_nonfinite(t, name, g.path)
        return hf, t

    # numpy releases the GIL in the dequantization kernels, so threads overlap usefully.
    threads = num_threads or min(4, len(affinity()))
    if threads <= 1:
        for job in jobs:
            yield load(job)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="gguf-dequant") as pool:
        # Bounded look-ahead keeps memory to a few tensors beyond what the consumer holds.
        pending = []
        it = iter(jobs)
        for job in it:
            pending.append(pool.submit(load, job))
            if len(pending) >= threads * 2:
                break
        while pending:
            fut = pending.pop(0)
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(load, nxt))
            yield fut.result()
