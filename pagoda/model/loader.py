"""Resolve a model path (HF safetensors folder or GGUF file) into config + weight iterator.

Pickle-based checkpoints (*.bin, *.pt, *.pth) are refused: unpickling runs arbitrary code. The config's
values and the checkpoint's headers are checked against each other before anything is allocated; a
malformed or inconsistent file raises ModelFileError, one line naming the file and the problem.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.model.args import ModelArgs
from pagoda.model.errors import ModelFileError, warn_nonfinite
from pagoda.model.locate import locate_model

_PICKLE_EXTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# The safetensors library refuses headers past 100 MB; checked here first to name the file.
_MAX_SAFETENSORS_HEADER = 100_000_000
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}  # safetensors dtype codes a float weight may have
_INT4_PARTS = ("qweight", "scales", "zeros")   # a saved INT4 checkpoint's tensors per linear


@dataclass
class ModelFiles:
    """A located model: its HF-style config and a way to stream its weights."""

    hf_config: dict[str, Any]
    source: str                      # the path as given (or the default model path)
    kind: str = "hf"                 # "hf" (config.json + safetensors folder) or "gguf"
    weight_files: list[str] = field(default_factory=list)  # safetensors shards, or [gguf file]
    _gguf: Any = field(default=None, repr=False)           # parsed GGUFFile for kind == "gguf"

    @property
    def folder(self) -> str:
        """Folder holding the model (tokenizer files live here for HF folders)."""
        return self.source if self.kind == "hf" else os.path.dirname(os.path.abspath(self.source))

    def iter_weights(self, dtype: torch.dtype = torch.float32,
                     select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor converted to `dtype`); lm_head is omitted when tied. `select`: only
        the tensors whose names it accepts, the others left unread (safetensors folders)."""
        if self.kind == "gguf":
            from pagoda.model.gguf_loader import iter_gguf_weights, split_experts

            yield from split_experts(iter_gguf_weights(self._gguf, self.hf_config, dtype))
            return
        from safetensors import SafetensorError, safe_open

        tied = bool(self.hf_config.get("tie_word_embeddings", False))
        for path in self.weight_files:
            try:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if select is not None and not select(name):
                            continue
                        # Buffers some exporters persist; recomputed by the model, not parameters.
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        if tied and name == "lm_head.weight":
                            continue
                        t = f.get_tensor(name)
                        t = t if t.dtype == dtype else t.to(dtype)
                        warn_nonfinite(t, name, path)
                        yield name, t
            except SafetensorError as e:
                raise ModelFileError(path, f"corrupt safetensors file ({e})") from None
            except OSError as e:
                raise ModelFileError(path, f"cannot read ({e.strerror or e})") from None


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype code, shape) from a safetensors file's header, checked against its size.

    Reads only the header, so a corrupt or truncated shard is named before any tensor is read."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise ModelFileError(path, f"corrupt safetensors header: its length {n} exceeds the "
                                       f"{size}-byte file (or the 100 MB limit)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFileError(path, f"corrupt safetensors header: invalid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "corrupt safetensors header: not a JSON object")
    data_size = size - 8 - n
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = (isinstance(dtype, str) and all(type(d) is int and d >= 0 for d in shape)
                  and type(begin) is int and type(end) is int and 0 <= begin <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ModelFileError(path, f"corrupt safetensors header: bad entry for tensor {name!r}")
        if end > data_size:
            raise ModelFileError(path, f"truncated: tensor {name} ends at data byte {end}, but the file "
                                       f"holds {data_size} bytes of data")
        tensors[name] = (dtype, shape)
    return tensors


def _load_config(folder: str) -> dict[str, Any]:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"model folder {folder!r} has no config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelFileError(cfg_path, f"invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(cfg_path, f"expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelFileError(index, f"malformed index ({e!r})") from None
        files = [os.path.join(folder, n) for n in names]
        missing = [n for n, p in zip(names, files) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"model folder {folder!r} is missing shards listed in the index: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        return files
    pickles = [n for n in sorted(os.listdir(folder)) if n.endswith(_PICKLE_EXTS)]
    if pickles:
        raise ValueError(
            f"model folder {folder!r} only has pickle checkpoints ({', '.join(pickles[:3])}); "
            "pagoda never unpickles weights (it can execute code). Convert them to safetensors, "
            "e.g. load with transformers and call save_pretrained(..., safe_serialization=True)")
    raise FileNotFoundError(f"model folder {folder!r} has no *.safetensors weight files")


def resolve_model_files(path: str | None) -> ModelFiles:
    """Locate a model: None -> embedded default GGUF; an HF folder; or a .gguf file."""
    if path is None:
        from pagoda.model.default_model import default_model_path

        path = default_model_path()
    path = locate_model(str(path))

    if os.path.isdir(path):
        cfg = _load_config(path)
        args = _checked_args(cfg, os.path.join(path, "config.json"))
        files = ModelFiles(hf_config=cfg, source=path, kind="hf", weight_files=_safetensors_files(path))
        check_checkpoint(files, args)
        return files

    if path.lower().endswith(".gguf"):
        from pagoda.model.gguf_loader import GGUFFile, gguf_hf_config

        g = GGUFFile(path)
        cfg = gguf_hf_config(g)
        files = ModelFiles(hf_config=cfg, source=path, kind="gguf", weight_files=[path], _gguf=g)
        check_checkpoint(files, _checked_args(cfg, path, "(from the GGUF metadata) "))
        return files

    if path.endswith(_PICKLE_EXTS):
        raise ValueError(f"refusing to load {path!r}: pickle checkpoints are never unpickled; "
                         "use a safetensors folder or a .gguf file")
    raise ValueError(f"unsupported model file {path!r}: pass a folder with config.json + *.safetensors, "
                     "or a .gguf file")


def _checked_args(cfg: dict[str, Any], path: str, origin: str = "") -> ModelArgs:
    """ModelArgs of `cfg`; a missing key or a bad value (sizes, rope_scaling) as a ModelFileError naming `path`."""
    from pagoda.layers.rotary import rope_inv_freq
    from pagoda.model.registry import model_class

    try:
        args = ModelArgs.from_hf_config(cfg)
    except ValueError as e:
        raise ModelFileError(path, f"{origin}{e}") from None
    try:
        model_class(args)
    except ValueError:
        return args  # an unsupported architecture: the model runner refuses it by name, not by its rope
    try:  # the model builds its rotary tables from these: an unknown or incomplete rope_scaling fails here
        rope_inv_freq(args.rotary_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
    except KeyError as e:
        raise ModelFileError(path, f"{origin}bad config value: rope_scaling lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(path, f"{origin}bad config value: rope_scaling ({e})") from None
    return args


def _stored_tensors(files: ModelFiles) -> Iterator[tuple[str, tuple[int, ...], str | None, str]]:
    """(HF name, shape, safetensors dtype code or None for GGUF, file) of every tensor in the checkpoint."""
    if files.kind == "gguf":
        from pagoda.model.gguf_loader import hf_tensor_names, per_expert

        g = files._gguf
        for name, hf in hf_tensor_names(g).items():
            for each, shape in per_expert(hf, g.tensors[name].shape):  # stacked experts: one weight per expert
                yield each, shape, None, g.path
        return
    from safetensors import SafetensorError, safe_open

    for path in files.weight_files:
        tensors = read_safetensors_header(path)
        try:  # the library's own checks too (each tensor's bytes match its shape), so no loader meets them later
            with safe_open(path, framework="pt", device="cpu"):
                pass
        except SafetensorError as e:
            raise ModelFileError(path, f"corrupt safetensors file ({e})") from None
        for name, (dtype, shape) in tensors.items():
            yield name, shape, dtype, path


def check_checkpoint(files: ModelFiles, args: ModelArgs) -> None:
    """Check the checkpoint's tensor names, shapes and dtypes against its config, before any allocation.

    Only headers are read, so a config claiming sizes its checkpoint lacks (hidden_size=100000 beside a
    tiny model) fails in milliseconds instead of allocating the model it describes."""
    from pagoda.model.registry import model_class

    qc = files.hf_config.get("quantization_config")
    int4 = isinstance(qc, dict) and qc.get("quant_method") == "pagoda"
    try:
        cls = model_class(args)
    except ValueError:
        return  # an unsupported architecture: the model runner says so when it builds the model
    if qc is not None and not int4:
        return  # a foreign quantization format: the quantized loader refuses it with its own message
    expected = cls.weight_shapes(args)  # type: ignore[attr-defined]
    optional = cls.optional_weight_shapes(args)  # type: ignore[attr-defined]
    config = "config.json" if files.kind == "hf" else "the GGUF metadata"
    dims = (f"vocab_size={args.vocab_size} hidden_size={args.hidden_size} intermediate_size="
            f"{args.intermediate_size} num_attention_heads={args.num_heads} num_key_value_heads="
            f"{args.num_kv_heads} head_dim={args.head_dim}")
    seen: set[str] = set()
    for name, shape, dtype, path in _stored_tensors(files):
        key = name.removeprefix("model.")
        # The same names load_weights skips: rotary buffers, and a tied head's stored copy.
        if "rotary_emb" in key or (args.tie_word_embeddings and key == "lm_head.weight"):
            continue
        stem, _, part = key.rpartition(".")
        packed = int4 and part in _INT4_PARTS
        if packed:
            key = stem + ".weight"
        if key in optional:
            if tuple(shape) != optional[key]:
                raise ModelFileError(path, f"{config} ({dims}) implies shape {optional[key]} for {name}, "
                                           f"but the file has {tuple(shape)}")
            continue
        if key not in expected:
            raise ModelFileError(path, f"unexpected tensor {name} for {config} "
                                       f"(num_hidden_layers={args.num_layers}, {dims})")
        if packed and part != "qweight":
            continue  # scales/zeros: the INT4 loader checks their group layout
        want = (expected[key][0], expected[key][1] // 2) if packed else expected[key]  # two 4-bit codes a byte
        if dtype is not None and (dtype in _FLOAT_DTYPES) == packed:
            raise ModelFileError(path, f"unsupported tensor type {dtype} for tensor {name}")
        if tuple(shape) != want:
            raise ModelFileError(path, f"{config} ({dims}) implies shape {want} for {name}, "
                                       f"but the file has {tuple(shape)}")
        seen.add(key)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ModelFileError(files.source, f"missing {len(missing)} of the {len(expected)} tensors {config} "
                                           f"implies (num_hidden_layers={args.num_layers}), e.g. {missing[:3]}")
