"""Shared fixtures: tiny random-weight models built from a config, and the embedded SmolLM2."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Keep each test process to the machine's cores without oversubscribing when xdist-like runners fork.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def build_tiny_model(path: Path, arch: str, **overrides) -> Path:
    """Save a tiny random-weight HF model (safetensors) to `path` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **common))
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path


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
def smollm_llm():
    from pagoda import LLM
    return LLM(dtype="float32", kv_cache_memory="256MiB")
