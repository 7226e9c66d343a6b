"""Shared fixtures: tiny random-weight models built from a config, and the embedded SmolLM2."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model

# Keep each test process to the machine's cores without oversubscribing when xdist-like runners fork.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Engines choose the built-in kernels: which layout a layer gets must not depend on a timing (tests/
# test_kernel_tuning.py turns tuning on where it tests it, with its own cache file). Server subprocesses inherit it.
os.environ.setdefault("PAGODA_KERNEL_TUNING", "off")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kernels", choices=("auto", "native", "avx2"), default="auto",
                     help="the build of the C++ CPU kernels this session loads before collecting (auto: the CPU's "
                          "best); every engine and kernel test then runs it (tests/test_kernels_avx2.py)")


def pytest_configure(config: pytest.Config) -> None:
    """With --kernels native|avx2, load that build first: a process holds one, and `kernels="auto"` engines and the
    kernel tests' skip marks take the loaded one. A build that fails to load, or loads without its own ISA, stops
    the session rather than let the tests pass on torch fallbacks."""
    build = config.getoption("--kernels")
    if build == "auto":
        return
    from pagoda.kernels import cpu_extension

    if not cpu_extension.load(build):
        raise pytest.UsageError(f"--kernels {build}: the C++ kernels' {build} build did not load")
    isa = cpu_extension.build_isa()
    if build == "avx2" and (isa.name != "avx2" or isa.avx512):
        raise pytest.UsageError(f"--kernels avx2 loaded a build compiled for {sorted(isa.features)}")


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("--kernels") == "auto":
        return None
    from pagoda.kernels import cpu_extension

    isa = cpu_extension.build_isa()
    features = " ".join(sorted(isa.features))
    return f"pagoda C++ kernels: {cpu_extension.loaded_build()} build, kernel set {isa.name} ({features})"


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
