"""Gemma 2 and Gemma 3 (text): tiny random models built from transformers configs with every Gemma feature on,
and Pagoda's greedy tokens equal to transformers' fp32 ones, from safetensors and from a GGUF laid out as
llama.cpp's converter writes it.

The features: the embedding scaled by sqrt(hidden); (1 + w) RMSNorms with random w (transformers starts w at 0,
where a missing 1 or a w applied twice would not show), four a layer; gelu-tanh(gate) * up; a query_pre_attn_scalar
apart from head_dim; sliding-window layers (window 6, shorter than the prompts) between global ones. Gemma 2 adds
the attention and final logit soft-caps (small caps, so they bind); Gemma 3 the per-head q/k norms and a local RoPE
base apart from the global one, whose RoPE is linearly scaled.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import (
    GGUF_LAYER,
    add_gguf_hparams,
    finish_gguf,
    gguf_tensor_name,
    greedy_tokens,
    hf_argmax_agreement,
    hf_greedy,
    seeded_samples_and_singles,
    variant,
    worst_prompt_logprob_error,
)

from pagoda import LLM, SamplingParams
from pagoda.model.args import ModelArgs
from pagoda.model.gemma import GemmaArgs

WINDOW = 6
NEW = 24
HEAD_DIM = 16
# Two share a 12-token prefix (three blocks of 4: prefix caching); all but one are longer than the window.
PROMPTS = [[5, 17, 99, 3, 250, 8, 9, 10, 11, 12, 13, 14, 60, 61], list(range(10, 47)), [7],
           list(range(100, 300, 3)), [5, 17, 99, 3, 250, 8, 9, 10, 11, 12, 13, 14, 400, 401, 402]]
GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}


def build_gemma(path: Path, arch: str, **overrides: Any) -> str:
    """Save a tiny random Gemma 2 ("gemma2") or Gemma 3 text ("gemma3") model; `overrides` go to its config."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    kw: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0, sliding_window=WINDOW, query_pre_attn_scalar=24)
    if arch == "gemma2":  # layer_types: transformers' default, sliding from layer 0 on every other layer
        kw |= dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = Gemma2ForCausalLM(Gemma2Config(**(kw | overrides)))
    else:
        kw |= dict(layer_types=GEMMA3_TYPES, rope_parameters=GEMMA3_ROPE)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**(kw | overrides)))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("norm.weight") else 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_tokens(model_dir: str) -> list[list[int]]:
    """transformers' greedy tokens on PROMPTS."""
    return hf_greedy(model_dir, PROMPTS, NEW)


def generate(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS, NEW)


def run(model: str, tokenizer: str, **kw: Any) -> list[list[int]]:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", "16MiB")
    return generate(LLM(model, tokenizer=tokenizer, **kw))


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> str:
    return build_gemma(tmp_path_factory.mktemp("tiny_gemma2"), "gemma2")


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> str:
    return build_gemma(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3")


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tiny_gemma2, tiny_gemma3) -> tuple[str, list[list[int]]]:
    """(model folder, transformers' greedy tokens) of each family."""
    path = tiny_gemma2 if request.param == "gemma2" else tiny_gemma3
    return path, hf_tokens(path)


def test_gemma_configs_parse_into_their_layer_windows_and_ropes(tiny_gemma2, tiny_gemma3):
    # The tiny models' configs as transformers 5 saves them (layer_types, rope_parameters per layer type).
    a2 = ModelArgs.from_hf_config(json.loads((Path(tiny_gemma2) / "config.json").read_text()))
    assert a2.layer_windows == [WINDOW, 0, WINDOW, 0] and a2.tie_word_embeddings and not a2.qk_norm
    g2 = GemmaArgs.from_args(a2)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar) == (5.0, 3.0, 24.0)
    assert g2.rope_local_theta is None
    a3 = ModelArgs.from_hf_config(json.loads((Path(tiny_gemma3) / "config.json").read_text()))
    assert a3.layer_windows == [WINDOW, WINDOW, 0, WINDOW] and a3.qk_norm
    assert a3.rope_theta == 1e6 and a3.rope_scaling is not None and a3.rope_scaling["factor"] == 4.0
    g3 = GemmaArgs.from_args(a3)
    assert g3.rope_local_theta == 10000.0 and g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    # Configs as the Hub ships them: no layer_types; Gemma 3's pattern and local base as their own keys.
    sizes = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=12,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256)
    hub2 = ModelArgs.from_hf_config({"architectures": ["Gemma2ForCausalLM"], **sizes, "sliding_window": 4096,
                                     "rope_theta": 10000.0, "query_pre_attn_scalar": 256})
    assert hub2.layer_windows == [4096, 0] * 6 and hub2.rms_norm_eps == 1e-6 and hub2.tie_word_embeddings
    assert GemmaArgs.from_args(hub2).attn_logit_softcapping == 50.0  # Gemma2Config's defaults
    hub3 = ModelArgs.from_hf_config({"architectures": ["Gemma3ForCausalLM"], **sizes, "sliding_window": 512,
                                     "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert hub3.layer_windows == ([512] * 5 + [0]) * 2 and hub3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert GemmaArgs.from_args(hub3).rope_local_theta == 10000.0
    # No layer_types and no pattern: transformers' default of 6; a model_type alone names the class.
    bare = ModelArgs.from_hf_config({"model_type": "gemma3_text", **sizes, "sliding_window": 512})
    assert bare.architecture == "Gemma3ForCausalLM" and bare.layer_windows == ([512] * 5 + [0]) * 2
    assert bare.rope_theta == 1e6


def test_hf_itself_feels_each_gemma_feature(tiny_gemma2, tiny_gemma3, tmp_path):
    """The prompts are long enough, and the caps small enough, that transformers gives other tokens without the
    attention soft-cap, the window, the query_pre_attn_scalar or Gemma 3's local RoPE base."""
    ref2, ref3 = hf_tokens(tiny_gemma2), hf_tokens(tiny_gemma3)
    assert hf_tokens(variant(tiny_gemma2, tmp_path / "a", attn_logit_softcapping=None)) != ref2
    assert hf_tokens(variant(tiny_gemma2, tmp_path / "b", layer_types=["full_attention"] * 4)) != ref2
    assert hf_tokens(variant(tiny_gemma2, tmp_path / "c", query_pre_attn_scalar=HEAD_DIM)) != ref2
    assert hf_tokens(variant(tiny_gemma3, tmp_path / "d", layer_types=["full_attention"] * 4)) != ref3
    same_base = {**GEMMA3_ROPE, "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    assert hf_tokens(variant(tiny_gemma3, tmp_path / "e", rope_parameters=same_base)) != ref3


def test_tiny_gemma_matches_hf(tiny, default_gguf):
    path, ref = tiny
    assert run(path, default_gguf) == ref
    # Chunked prefill in blocks of 4: the long prompts span many steps, windows cross block edges.
    assert run(path, default_gguf, max_num_batched_tokens=16, block_size=4) == ref
    assert run(path, default_gguf, kernels="torch") == ref  # the torch fallbacks (norms, attention, rope)


def test_tiny_gemma_prefix_cache_hits_give_the_same_tokens(tiny, default_gguf):
    path, ref = tiny
    llm = LLM(path, tokenizer=default_gguf, dtype="float32", block_size=4, enable_prefix_caching=True,
              kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for _ in range(2):  # the second pass reads the prompts' full blocks from the cache
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.num_cached_tokens >= len(p) - 8 for o, p in zip(outs, PROMPTS))


def test_tiny_gemma2_preempted_requests_resume_with_identical_tokens(tiny_gemma2, default_gguf):
    # 30 blocks of 4 tokens (K and V, 4 layers x 2 kv heads x 16 dims, fp32: 4 KiB a block) hold the longest
    # sequence (91 tokens) but not all five at once.
    llm = LLM(tiny_gemma2, tokenizer=default_gguf, dtype="float32", block_size=4, kv_cache_memory=30 * 4096)
    assert llm.engine.kv.pool.num_blocks == 30
    assert generate(llm) == hf_tokens(tiny_gemma2)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_prompt_logprobs_match_hf(arch, tiny_gemma2, tiny_gemma3, default_gguf):
    """Logprobs pin down what greedy tokens cannot: Gemma 2's final soft-cap is monotone, so only the
    logprobs show it."""
    path, prompt = (tiny_gemma2 if arch == "gemma2" else tiny_gemma3), PROMPTS[3]
    llm = LLM(path, tokenizer=default_gguf, dtype="float32", max_num_batched_tokens=16, kv_cache_memory="16MiB")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    # fp32 on both sides, the same math in another order (fused matmuls, chunked prefill): float rounding only
    # (measured: a few 1e-6). 1e-4 is far below what a wrong feature moves: the exact GELU in place of the tanh one
    # moves these logprobs by ~7e-4, leaving out Gemma 2's final cap by units.
    assert worst_prompt_logprob_error(path, prompt, out.prompt_logprobs) < 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_bf16_follows_hf(arch, tiny_gemma2, tiny_gemma3, default_gguf):
    """Teacher-forced argmax agreement with transformers fp32 over a long prompt: bf16 rounding may move a few of
    these random logits (measured: none; transformers' own bf16 moves 2 to 8%), a wrong feature moves most."""
    path, prompt = (tiny_gemma2 if arch == "gemma2" else tiny_gemma3), PROMPTS[3]
    llm = LLM(path, tokenizer=default_gguf, dtype="bfloat16", block_size=4, max_num_batched_tokens=32,
              kv_cache_memory="16MiB")
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == NEW
    assert hf_argmax_agreement(path, prompt, out.prompt_logprobs) >= 0.9


def write_gemma_gguf(hf_dir: Path, path: Path, pattern: list[bool] | None = None) -> Path:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py (Gemma2Model, Gemma3Model) writes it: arch gemma2 or
    gemma3, F32 tensors, every norm weight stored as 1 + w, no lm_head (tied), the soft-caps, the window and the
    global layers' RoPE as metadata; no query_pre_attn_scalar (llama.cpp takes head_dim). `pattern`: also write
    attention.sliding_window_pattern as one flag a layer."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = "gemma2" if cfg["model_type"] == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_hparams(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        rope = cfg["rope_parameters"]["full_attention"]
        w.add_rope_freq_base(rope["rope_theta"])
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    # Gemma's four norms a layer, as llama.cpp names them: attn_norm, post_attention_norm, ffn_norm, post_ffw_norm.
    layer = GGUF_LAYER | {"post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name == "lm_head.weight":
            continue
        t = t.float()
        if name.endswith("norm.weight"):
            t = t + 1  # the converter's modify_tensors: llama.cpp's norms scale by the weight alone
        w.add_tensor(gguf_tensor_name(name, layer), np.ascontiguousarray(t.numpy()))
    finish_gguf(w)
    return path


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_gguf_as_llama_cpp_writes_it_matches_hf(arch, tiny_gemma2, tmp_path, default_gguf):
    """llama.cpp stores no query_pre_attn_scalar (it takes head_dim), fixes Gemma 3's pattern at five local layers to
    one global, and adds 1 to the norms: these models have query_pre_attn_scalar = head_dim, and Gemma 3 six layers
    in that pattern; the GGUF loads with the norms' 1 taken back off, as floats and through quantization="gguf"."""
    from pagoda.model.loader import resolve_model_files

    if arch == "gemma2":
        hf_dir = variant(tiny_gemma2, tmp_path / "hf", query_pre_attn_scalar=HEAD_DIM)
    else:
        hf_dir = build_gemma(tmp_path / "hf", "gemma3", num_hidden_layers=6, layer_types=None,
                             query_pre_attn_scalar=HEAD_DIM)
    ref = hf_tokens(hf_dir)
    path = str(write_gemma_gguf(Path(hf_dir), tmp_path / f"tiny-{arch}.gguf"))
    cfg = resolve_model_files(path).hf_config
    args = ModelArgs.from_hf_config(cfg)
    expected_windows = [WINDOW, 0] * 2 if arch == "gemma2" else [WINDOW] * 5 + [0]
    assert args.layer_windows == expected_windows and args.tie_word_embeddings
    assert run(path, default_gguf) == ref
    assert run(path, default_gguf, max_num_batched_tokens=16, block_size=4) == ref
    assert run(path, default_gguf, quantization="gguf") == ref  # F32 tensors: the native path's floats


def test_gguf_sliding_window_pattern_flags_set_the_layer_types(tiny_gemma2, tmp_path):
    from pagoda.model.loader import resolve_model_files

    path = write_gemma_gguf(Path(tiny_gemma2), tmp_path / "p.gguf", pattern=[False, True, True, False])
    args = ModelArgs.from_hf_config(resolve_model_files(str(path)).hf_config)
    assert args.layer_windows == [0, WINDOW, WINDOW, 0]


def test_multimodal_gemma3_is_refused_by_name(tmp_path):
    folder = tmp_path / "gemma3-mm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 64}, "vision_config": {"hidden_size": 32}}))
    with pytest.raises(ValueError, match="unsupported architecture 'Gemma3ForConditionalGeneration'"):
        LLM(str(folder))


def test_gemma_configs_pagoda_cannot_serve_are_refused():
    cfg = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        GemmaArgs.from_args(ModelArgs.from_hf_config(cfg | {"use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="hidden_activation = 'relu'"):
        GemmaArgs.from_args(ModelArgs.from_hf_config(cfg | {"hidden_activation": "relu"}))


def test_tiny_gemma_parallel_samples_equal_each_sample_alone(tiny, default_gguf):
    """n > 1 siblings share the prompt's blocks across global and windowed layers."""
    llm = LLM(tiny[0], tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=16)
    together, alone = seeded_samples_and_singles(llm, PROMPTS[:3])
    assert together == alone
    assert any(len({tuple(s) for s in samples}) > 1 for samples in together)
