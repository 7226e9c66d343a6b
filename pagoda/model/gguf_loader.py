"""Read GGUF checkpoints: metadata -> HF-style config dict, tensors -> HF-named torch weights.

The header is parsed by a small reader of our own instead of `gguf.GGUFReader`: GGUFReader
builds a numpy memmap view per element of every metadata array, which costs ~2 s for the
98k token/merge strings of even a tiny model. Here string arrays are skipped (only their
length is kept) and the header parses in tens of milliseconds. Tensor data is memory-mapped
and dequantized with `gguf.quants.dequantize`, so the numerics are gguf-py's.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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

# GGUF architecture -> (HF architectures entry, HF model_type).
SUPPORTED_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


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
    """Parsed GGUF header (metadata + tensor directory); tensor data stays on disk (memmap)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        with open(path, "rb") as f:
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise ValueError(f"{path}: not a GGUF file ({e})") from None
        try:
            self._parse(buf)
        except struct.error as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None
        finally:
            buf.close()
        # Mapped up front (cheap) so dequantization threads never race to create it.
        self._data: np.memmap = np.memmap(path, dtype=np.uint8, mode="r")

    # -- header parsing ---------------------------------------------------------------
    def _parse(self, buf: mmap.mmap) -> None:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            # v1 used 32-bit counts; a huge value means a big-endian file. Neither is supported.
            raise ValueError(f"{self.path}: unsupported GGUF version {version} (need 2 or 3, little-endian)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        for _ in range(n_kv):
            key, off = self._read_str(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            value, off = self._read_value(buf, off + 4, vtype)
            self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name, off = self._read_str(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            qtype, rel = struct.unpack_from("<IQ", buf, off)
            off += 12
            infos.append((name, tuple(int(d) for d in dims), int(qtype), int(rel)))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (off + align - 1) // align * align
        for name, dims, qtype, rel in infos:
            self.tensors[name] = GGUFTensorInfo(name, dims, qtype, data_start + rel)

    @staticmethod
    def _read_str(buf: mmap.mmap, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, off)
        return buf[off + 8: off + 8 + n].decode("utf-8", errors="replace"), off + 8 + n

    def _read_value(self, buf: mmap.mmap, off: int, vtype: int) -> tuple[Any, int]:
        if vtype == _T_STRING:
            return self._read_str(buf, off)
        if vtype in _SCALAR_FMT:
            fmt = _SCALAR_FMT[vtype]
            return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
        if vtype == _T_ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if etype == _T_STRING:
                if count > _MAX_KEPT_STRINGS:
                    for _ in range(count):  # skip: only the length is needed (vocab size)
                        off += 8 + struct.unpack_from("<Q", buf, off)[0]
                    return SkippedStrings(count), off
                items = []
                for _ in range(count):
                    s, off = self._read_str(buf, off)
                    items.append(s)
                return items, off
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype])
                arr = np.frombuffer(buf, dtype=dt, count=count, offset=off).copy()
                return (arr.tolist() if count <= _MAX_KEPT_STRINGS else arr), off + dt.itemsize * count
            if etype == _T_ARRAY:  # nested arrays: rare, parse generically
                items = []
                for _ in range(count):
                    v, off = self._read_value(buf, off, _T_ARRAY)
                    items.append(v)
                return items, off
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype}")

    # -- accessors ----------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: GGUF metadata lacks general.architecture")
        return arch

    def raw_tensor(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, shaped the way gguf.quants.dequantize expects."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.qtype)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        row = info.dims[0]
        if row % block_size:
            raise ValueError(f"{name}: row length {row} not a multiple of block size {block_size}")
        row_bytes = row // block_size * type_size
        n_rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        raw = self._data[info.offset: info.offset + n_rows * row_bytes]
        if raw.size != n_rows * row_bytes:
            raise ValueError(f"{self.path}: tensor {name} extends past the end of the file")
        return raw.reshape(*info.shape[:-1], row_bytes)

    def dequantized(self, name: str) -> np.ndarray:
        """float32 numpy array (logical shape) of a tensor."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        out = dequantize(self.raw_tensor(name), GGMLQuantizationType(info.qtype))
        return out.reshape(info.shape)


def _meta(g: GGUFFile, key: str, default: Any = None) -> Any:
    return g.fields.get(f"{g.architecture}.{key}", default)


def gguf_hf_config(g: GGUFFile) -> dict[str, Any]:
    """Build an HF config.json-style dict from GGUF metadata."""
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{g.path}: unsupported GGUF architecture {arch!r} "
                         f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    hf_arch, model_type = SUPPORTED_ARCHS[arch]
    required = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads"}
    missing = [f"{arch}.{k}" for k in required if _meta(g, k) is None]
    if missing:
        raise ValueError(f"{g.path}: GGUF metadata lacks {', '.join(missing)}")
    hidden = int(_meta(g, "embedding_length"))
    heads = int(_meta(g, "attention.head_count"))
    kv_heads = int(_meta(g, "attention.head_count_kv") or heads)

    vocab = _meta(g, "vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in g.fields:
        vocab = len(g.fields["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in g.tensors:
        vocab = g.tensors["token_embd.weight"].shape[0]
    if vocab is None:
        raise ValueError(f"{g.path}: cannot determine vocab size")

    default_theta = 1_000_000.0 if arch == "qwen2" else 10_000.0
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(g, "block_count")),
        "intermediate_size": int(_meta(g, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_meta(g, "attention.key_length") or hidden // heads),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(_meta(g, "attention.layer_norm_rms_epsilon", 1e-6 if arch == "qwen2" else 1e-5)),
        "rope_theta": float(_meta(g, "rope.freq_base", default_theta)),
        "rope_scaling": None,
        "max_position_embeddings": int(_meta(g, "context_length", 2048)),
        # llama.cpp omits output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": arch == "qwen2",
        "torch_dtype": "float32",
    }
    scaling_type = _meta(g, "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rs: dict[str, Any] = {"rope_type": scaling_type, "type": scaling_type,
                              "factor": float(_meta(g, "rope.scaling.factor", 1.0))}
        orig = _meta(g, "rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs
    bos = g.fields.get("tokenizer.ggml.bos_token_id")
    eos = g.fields.get("tokenizer.ggml.eos_token_id")
    eot = g.fields.get("tokenizer.ggml.eot_token_id")
    cfg["bos_token_id"] = int(bos) if bos is not None else None
    if eos is not None and eot is not None and int(eot) != int(eos):
        cfg["eos_token_id"] = [int(eos), int(eot)]
    else:
        cfg["eos_token_id"] = int(eos) if eos is not None else None
    pad = g.fields.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = int(pad)
    return cfg


_LAYER_MAP = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors that carry no HF parameter (llama3 rope frequencies are folded into the rope config).
_IGNORED = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name for a GGUF tensor name; None when there is no equivalent."""
    m = _BLK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_MAP.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    stem, _, kind = name.rpartition(".")
    hf = _TOP_MAP.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (weight or bias).

    The converter regroups each head's rows from HF's rotate-half layout [first half; second
    half] into interleaved pairs (row 2i from the first half, 2i+1 from the second). Viewing
    rows as (head, pair, 2) and swapping the last two axes restores the HF order.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_gguf_weights(g: GGUFFile, hf_config: dict[str, Any], dtype: torch.dtype,
                      num_threads: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every parameter in the GGUF file, dequantized to `dtype`."""
    arch = g.architecture
    permute = arch == "llama"  # qwen2's converter keeps the HF row layout
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    jobs: list[tuple[str, str]] = []
    for name in g.tensors:
        if name in _IGNORED:
            logger.info("ignoring GGUF tensor %s", name)
            continue
        hf = gguf_to_hf_name(name)
        if hf is None:
            raise ValueError(f"{g.path}: GGUF tensor {name!r} has no known HF equivalent for arch {arch!r}")
        jobs.append((name, hf))

    def load(job: tuple[str, str]) -> tuple[str, torch.Tensor]:
        name, hf = job
        arr = g.dequantized(name)
        if permute and ".attn_q." in name:
            arr = unpermute_qk(arr, heads)
        elif permute and ".attn_k." in name:
            arr = unpermute_qk(arr, kv_heads)
        # F32/F16 tensors come back as views of the read-only memmap: torch needs owned memory.
        arr = arr.copy() if not arr.flags.writeable else np.ascontiguousarray(arr)
        t = torch.from_numpy(arr)
        return hf, t if t.dtype == dtype else t.to(dtype)

    # numpy releases the GIL in the dequantization kernels, so threads overlap usefully.
    threads = num_threads or min(4, os.cpu_count() or 1)
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
