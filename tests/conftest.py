"""Shared fixtures: tiny random-weight models built from a config, and the embedded SmolLM2."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model

# Keep each test process to the machine's cores without oversubscribing when xdist-like runners fork.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from pagoda.model.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama"))


@pytest.fixture
def tiny_llama_byte_tokenizer(tiny_llama, tmp_path) -> Path:
    """A copy of the tiny Llama folder with a byte-level tokenizer.json (ids 0..255 fit any vocab >= 256)."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    dest = tmp_path / "model"
    shutil.copytree(tiny_llama, dest)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(dest / "tokenizer.json"))
    return dest


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """Qwen3: per-head q/k norms, head_dim apart from hidden / heads."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tie_word_embeddings=True))


@pytest.fixture(scope="session")
def smollm_llm():
    from pagoda import LLM
    return LLM(dtype="float32", kv_cache_memory="256MiB")
