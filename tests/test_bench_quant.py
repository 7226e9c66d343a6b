"""`pagoda bench quant` helpers: row parsing, weight accounting, and the llama.cpp peer's job format."""
from __future__ import annotations

import os

import pytest
import torch

from pagoda.bench import llama_cpp_peer
from pagoda.bench.datasets import CORPUS_PATH
from pagoda.bench.quant_table import parse_row, weight_bytes


def test_parse_row():
    assert parse_row("float32", "m.gguf").dtype == "float32"
    r = parse_row("int4", "m.gguf")
    assert (r.model, r.dtype, r.quantization) == ("m.gguf", "auto", "int4")
    r = parse_row("int4-awq=ckpt/awq", "m.gguf")
    assert (r.name, r.model, r.quantization, r.int8_activations) == ("int4-awq", "ckpt/awq", None, False)
    r = parse_row("gguf+a8", "m.gguf")
    assert (r.name, r.model, r.quantization, r.int8_activations) == ("gguf+a8", "m.gguf", "gguf", True)
    r = parse_row("int4-awq+a8=ckpt/awq", "m.gguf")
    assert (r.name, r.model, r.quantization, r.int8_activations) == ("int4-awq+a8", "ckpt/awq", None, True)


def test_a8_rows_load_their_models_with_int8_activations(tiny_llama, default_gguf):
    import argparse

    from pagoda.bench.quant_table import _load
    from pagoda.kernels.cpu_extension import kernel_available

    llm = _load(parse_row("int4+a8", tiny_llama), argparse.Namespace(concurrency=4, seed=0, dtype="auto",
                                                                      kernels="auto"),
                tokenizer=default_gguf, kv_cache_memory="16MiB")
    assert llm.engine.config.quant_activations == "int8"
    pw = llm.engine.runner.model.layers[0].mlp.gate_up_proj.qweight
    x8 = kernel_available() and torch.ops.pagoda.int4x8_supported(64, 64)  # AVX2 or VNNI
    assert (pw.format, pw.layout) == ("int4", "interleave8" if x8 else "rows")


def test_weight_bytes_counts_each_storage_once_and_skips_caches():
    lin = torch.nn.Linear(64, 32)
    emb = torch.nn.Embedding(10, 64)
    model = torch.nn.ModuleDict({"lin": lin, "emb": emb})
    expected = (64 * 32 + 32 + 10 * 64) * 4
    assert weight_bytes(model) == expected
    lin.k_cache = torch.zeros(1000)  # KV pools are not weights
    tied = torch.nn.Linear(64, 10, bias=False)
    tied.weight = emb.weight  # tied weights count once
    model["tied"] = tied
    assert weight_bytes(model) == expected


def test_quantized_model_is_smaller(default_gguf):
    from pagoda import LLM

    f32 = weight_bytes(LLM(dtype="float32", kv_cache_memory="64MiB").engine.runner.model)
    assert 500e6 < f32 < 560e6  # 135M parameters, tied embedding counted once
    q4 = weight_bytes(LLM(quantization="int4", kv_cache_memory="64MiB").engine.runner.model)
    assert q4 < 0.4 * f32


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(llama_cpp_peer.DEFAULT_LLAMA_PYTHON), reason="llama.cpp peer not installed")
def test_llama_cpp_peer_perplexity_agrees_with_ours(default_gguf):
    """Same GGUF, same token ids: llama.cpp's perplexity and ours (float32) agree within 2%."""
    from pagoda import LLM
    from pagoda.bench.llama_cpp_peer import run_llama_cpp
    from pagoda.eval.perplexity import perplexity, sliding_windows

    llm = LLM(dtype="float32", kv_cache_memory="128MiB")
    ids = llm.get_tokenizer().encode(CORPUS_PATH.read_text()[:3000])
    ours = perplexity(llm, ids, 128, 64).perplexity
    windows = sliding_windows(len(ids), 128, 64)
    peer = run_llama_cpp(default_gguf, perplexity=([ids[w.begin:w.end] for w in windows],
                                                   [w.end - w.begin - w.num_scored for w in windows]),
                         batch1=(ids[:16], 8), batch1_repeats=2)
    assert abs(peer["perplexity"]["perplexity"] / ours - 1) < 0.02
    assert peer["batch1"]["decode_tokens"] == 7 and peer["batch1"]["decode_s"] > 0
