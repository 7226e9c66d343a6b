"""An HF-format (safetensors + tokenizer) copy of a GGUF model, for peers that cannot read GGUF (vLLM).

transformers dequantizes the GGUF on load; `save_pretrained` then refuses the model while it still
carries the GGUF quantizer, so the quantizer and `config.quantization_config` are dropped first (with a
fallback that rebuilds the model from its config and loads the state dict into it). The copy is made
once per GGUF file and cached in pagoda's cache folder (pagoda/paths.py), hf_copies/<hash>/,
keyed by the file's content hash. It is written into a temporary folder beside the final one and
renamed into place, so a crash or a concurrent run never leaves a half-written copy behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from typing import Any

from pagoda import paths

# Bump when the copy's layout or contents change, so old copies are not reused.
_COPY_VERSION = 1
_MARKER = "pagoda_hf_copy.json"
# Dequantized weights are kept in fp32: exact for Q4/Q8 blocks, and any peer can cast them down.
_SAVE_DTYPE = "float32"


def hf_copies_dir() -> str:
    return str(paths.hf_copies_dir())


def file_digest(path: str, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes (about 0.3 s for a 100 MB GGUF)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def copy_key(gguf_path: str) -> str:
    """The cache folder name of a GGUF file's copy."""
    return hashlib.sha256(f"v{_COPY_VERSION}:{_SAVE_DTYPE}:{file_digest(gguf_path)}".encode()).hexdigest()[:24]


def is_complete_copy(folder: str) -> bool:
    """True where `folder` holds a finished copy (the marker is written last, before the rename)."""
    return (os.path.isfile(os.path.join(folder, _MARKER)) and os.path.isfile(os.path.join(folder, "config.json"))
            and any(n.endswith(".safetensors") for n in os.listdir(folder)))


def ensure_hf_copy(gguf_path: str) -> str:
    """The folder of an HF-format safetensors copy of `gguf_path` with its tokenizer; made on first use.

    An HF folder (anything that is not a .gguf file) is returned as it is.
    """
    gguf_path = os.path.abspath(gguf_path)
    if os.path.isdir(gguf_path):
        return gguf_path
    if not gguf_path.endswith(".gguf"):
        raise ValueError(f"expected a .gguf file or an HF folder, got {gguf_path}")
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(gguf_path)
    root = hf_copies_dir()
    final = os.path.join(root, copy_key(gguf_path))
    if is_complete_copy(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        _write_copy(gguf_path, tmp)
        if os.path.isdir(final):  # an incomplete leftover (complete ones returned above)
            if is_complete_copy(final):
                return final
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy into place first: use that one.
            if not is_complete_copy(final):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _load_gguf(gguf_path: str, dtype: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = os.path.split(gguf_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        # The dequantization progress bar (a bare tqdm on stderr) would swamp callers' output.
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval(), tokenizer


def _add_legacy_config_keys(config_path: str) -> None:
    """Also write the older spellings of renamed config keys (rope_theta, torch_dtype), so that a peer
    pinned to an older transformers reads the same RoPE base and dtype rather than its defaults."""
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") == "default" and "rope_scaling" not in cfg:
            cfg["rope_scaling"] = None
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def _write_copy(gguf_path: str, dest: str) -> None:
    import torch

    dtype = getattr(torch, _SAVE_DTYPE)
    model, tokenizer = _load_gguf(gguf_path, dtype)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with contextlib.redirect_stderr(io.StringIO()):  # the shard-writing progress bar
        try:
            model.save_pretrained(dest, safe_serialization=True)
        except Exception:  # noqa: BLE001 - fall back to a plain model built from the config
            from transformers import AutoModelForCausalLM

            for n in os.listdir(dest):
                p = os.path.join(dest, n)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            plain = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
            plain.load_state_dict(model.state_dict())
            plain.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
    _add_legacy_config_keys(os.path.join(dest, "config.json"))
    # Written last: a folder with this marker is complete.
    with open(os.path.join(dest, _MARKER), "w", encoding="utf-8") as f:
        json.dump({"version": _COPY_VERSION, "source": gguf_path, "dtype": _SAVE_DTYPE,
                   "source_bytes": os.path.getsize(gguf_path)}, f, indent=1)
