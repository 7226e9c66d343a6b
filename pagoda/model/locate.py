"""Where a model named on the command line or in `LLM(model=...)` lives: a local folder or file, or a Hugging Face
hub id that the local hub cache already holds. Nothing is downloaded: a missing model is an error that says how
to get it. Free of torch, so the CLI can check a model before the seconds of importing it."""
from __future__ import annotations

import os
import re

# org/name as the hub spells ids: what a path that does not exist may have meant.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def locate_model(model: str) -> str:
    """The local path of `model`: the path itself where it exists, else the hub cache's snapshot of a hub id
    (as transformers finds it offline). Raises FileNotFoundError saying how to get the files."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if not _HUB_ID.match(model):
        raise FileNotFoundError(f"model path does not exist: {model!r} (pagoda only loads local files)")
    cached = _hub_snapshot(model)
    if cached is not None:
        return cached
    raise FileNotFoundError(
        f"model path does not exist: {model!r}. If it is a Hugging Face hub id, pagoda loads local files only and "
        f"found none in the hub cache: download it first (`hf download {model} --local-dir DIR`, then pass DIR), "
        f"or pass a .gguf file. {_fits_in_memory()}")


def _hub_snapshot(repo_id: str) -> str | None:
    """The folder of the hub cache's snapshot of `repo_id` with its config.json, or None."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        folder = snapshot_download(repo_id, local_files_only=True)
    except (ImportError, LocalEntryNotFoundError, ValueError, OSError):
        return None
    return folder if isinstance(folder, str) and os.path.isfile(os.path.join(folder, "config.json")) else None


def _fits_in_memory() -> str:
    """What size of model this machine can hold, in words."""
    try:
        import psutil

        free = psutil.virtual_memory().available
    except (ImportError, OSError):
        return ""
    gib = free / 2**30
    # bf16 weights take 2 bytes a parameter and a 4-bit GGUF about 0.6; a third is left for the KV cache and more.
    return (f"This machine has {gib:.1f} GiB free: about {gib * 2 / 3 / 2:.0f}B parameters in bf16, or "
            f"{gib * 2 / 3 / 0.6:.0f}B in a 4-bit GGUF.")
