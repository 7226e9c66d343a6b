"""Phi-3 (Phi3ForCausalLM): q|k|v and gate|up stored fused, LongRoPE, partial rotary, from safetensors and GGUF.

The tiny model (tiny_models.phi3_longrope) has its pretraining context L = original_max_position_embeddings
= 64 and max_position_embeddings 512. transformers uses the short factors for a sequence of at most L tokens
and the long ones past it; Pagoda picks the set once per engine by max_model_len (layers/rotary.py). So
prompts past L run with the default max_model_len (512: long), and prompts that stay within L with
max_model_len = 64 (short), and each must equal transformers token for token.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_models import (
    GGUF_LAYER,
    add_gguf_hparams,
    build_tiny_model,
    finish_gguf,
    gguf_tensor_name,
    greedy_tokens,
    hf_argmax_agreement,
    hf_greedy,
    seeded_samples_and_singles,
    variant,
    with_architecture,
    worst_prompt_logprob_error,
)

from pagoda import LLM, SamplingParams
from pagoda.model.errors import ModelFileError

ORIG = 64
NEW = 24
# Past L from the prompt on; the first two share a 70-token prefix (prefix caching).
LONG = [list(range(10, 90)), list(range(10, 80)) + [401, 402, 403, 404, 405, 406, 407],
        [(7 * i) % 500 + 3 for i in range(130)], list(range(300, 400))]
# Within L to the last generated token (at most L - NEW + 1 prompt tokens, as transformers counts).
SHORT = [[5, 17, 99, 3, 250], list(range(10, 47)), [7], list(range(100, 130))]


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), "phi3"))


@pytest.fixture(scope="module")
def hf_long(tiny_phi3) -> list[list[int]]:
    return hf_greedy(tiny_phi3, LONG, NEW)


@pytest.fixture(scope="module")
def hf_short(tiny_phi3) -> list[list[int]]:
    return hf_greedy(tiny_phi3, SHORT, NEW)


def generate(model: str, tokenizer: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    return greedy_tokens(LLM(model, tokenizer=tokenizer, dtype=kw.pop("dtype", "float32"), **kw), prompts, NEW)


def test_tiny_phi3_with_longrope_and_partial_rotary_matches_hf(tiny_phi3, default_gguf, hf_long, hf_short):
    assert generate(tiny_phi3, default_gguf, LONG) == hf_long
    assert generate(tiny_phi3, default_gguf, SHORT, max_model_len=ORIG) == hf_short
    # Chunked prefill in blocks of 4: the long prompts span many steps and blocks.
    assert generate(tiny_phi3, default_gguf, LONG, max_num_batched_tokens=16, block_size=4) == hf_long
    assert generate(tiny_phi3, default_gguf, SHORT, max_model_len=ORIG, max_num_batched_tokens=8,
                    block_size=4) == hf_short
    assert generate(tiny_phi3, default_gguf, LONG, kernels="torch") == hf_long  # the torch fallbacks' partial rotary


def test_tiny_phi3_prefix_cache_hits_give_the_same_tokens(tiny_phi3, default_gguf, hf_long):
    llm = LLM(tiny_phi3, tokenizer=default_gguf, dtype="float32", block_size=4, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for _ in range(2):  # the second pass reads the prompts' full blocks from the cache
        outs = llm.generate(LONG, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_long
    assert all(o.num_cached_tokens >= len(p) - 8 for o, p in zip(outs, LONG))


def test_tiny_phi3_preempted_requests_resume_with_identical_tokens(tiny_phi3, default_gguf, hf_long):
    # 48 blocks of 4 tokens (K and V, 2 layers x 2 kv heads x 16 dims, fp32: 2 KiB a block) hold the longest
    # sequence (154 tokens) but not all four at once.
    llm = LLM(tiny_phi3, tokenizer=default_gguf, dtype="float32", block_size=4, kv_cache_memory=48 * 2048)
    assert llm.engine.kv.pool.num_blocks == 48
    outs = llm.generate(LONG, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_long


def test_the_longrope_factor_set_follows_max_model_len(tiny_phi3, default_gguf, hf_short):
    """The tests above would see a wrong set: on the short prompts the long set (max_model_len 512 > L) gives
    other tokens than transformers' short set."""
    assert generate(tiny_phi3, default_gguf, SHORT) != hf_short


@pytest.mark.parametrize("prompt,max_model_len", [(LONG[2], None), (SHORT[1], ORIG)])
def test_tiny_phi3_prompt_logprobs_match_hf(tiny_phi3, default_gguf, prompt, max_model_len):
    llm = LLM(tiny_phi3, tokenizer=default_gguf, dtype="float32", max_num_batched_tokens=16,
              max_model_len=max_model_len)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    # fp32 on both sides, the same math in another order (fused matmuls, C++ kernels, chunked prefill): logprobs of
    # size ~10 differ by float rounding only (measured under 1e-5); 1e-4 leaves room for that and is far below
    # what a wrong rope moves (the other factor set, or none, changes the greedy tokens).
    assert worst_prompt_logprob_error(tiny_phi3, prompt, out.prompt_logprobs) < 1e-4


@pytest.mark.parametrize("dtype,quantization,agreement", [("bfloat16", None, 0.9), ("float32", "int8", 0.85),
                                                            ("float32", "int4", 0.3), ("bfloat16", "int4", 0.3)])
def test_tiny_phi3_bf16_and_quantized_follow_hf(tiny_phi3, default_gguf, dtype, quantization, agreement):
    """The stored fused matrices go through the quantizing stream transforms like any Linear's. Teacher-forced
    argmax agreement with transformers fp32 over a long prompt: rounding moves these random logits (int4 RTN on
    N(0, 0.2) weights most), but a quantized matrix in the wrong rows agrees near chance (gate and up swapped: 5%)."""
    prompt = LONG[2]
    llm = LLM(tiny_phi3, tokenizer=default_gguf, dtype=dtype, quantization=quantization, block_size=4,
              max_num_batched_tokens=32)
    if quantization:
        attn, mlp = llm.engine.runner.model.layers[0].self_attn, llm.engine.runner.model.layers[0].mlp
        assert attn.qkv_proj.qweight is not None and mlp.gate_up_proj.qweight is not None
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == NEW
    assert hf_argmax_agreement(tiny_phi3, prompt, out.prompt_logprobs) >= agreement


def test_tiny_phi3_gguf_as_llama_cpp_writes_it_matches_hf(tiny_phi3, default_gguf, hf_long, hf_short, tmp_path):
    from pagoda.model.loader import resolve_model_files

    path = write_phi3_gguf(Path(tiny_phi3), tmp_path / "tiny-phi3.gguf")
    cfg = resolve_model_files(str(path)).hf_config
    assert cfg["architectures"] == ["Phi3ForCausalLM"] and cfg["partial_rotary_factor"] == 0.75
    assert cfg["rope_scaling"]["rope_type"] == "longrope" and cfg["original_max_position_embeddings"] == ORIG
    assert generate(str(path), default_gguf, LONG, max_num_batched_tokens=16, block_size=4) == hf_long
    assert generate(str(path), default_gguf, SHORT, max_model_len=ORIG) == hf_short
    # int4 on a GGUF reads its tensors by GGUF name (quantization/gguf_native.py): the fused ffn_up is gate|up.
    llm = LLM(str(path), tokenizer=default_gguf, dtype="float32", quantization="int4", kv_cache_memory="16MiB")
    assert llm.engine.runner.model.layers[0].mlp.gate_up_proj.qweight is not None
    out = llm.generate(LONG[:1], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == NEW


def write_phi3_gguf(hf_dir: Path, path: Path, leave_out: str | None = None) -> Path:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py (Phi3MiniModel) writes it: arch phi3, F32 tensors,
    qkv_proj as attn_qkv and gate_up_proj as ffn_up (rows as in HF), LongRoPE factors as two tensors
    (`leave_out` names one not to write)."""
    import math

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    orig, ctx = cfg["original_max_position_embeddings"], cfg["max_position_embeddings"]
    w = gguf.GGUFWriter(str(path), "phi3")
    add_gguf_hparams(w, cfg)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * hidden) // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(0)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(ctx / orig) / math.log(orig)))
    for kind in ("long", "short"):
        if leave_out != f"rope_factors_{kind}.weight":
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    layer = GGUF_LAYER | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        w.add_tensor(gguf_tensor_name(name, layer), np.ascontiguousarray(t.float().numpy()))
    finish_gguf(w)
    return path


def test_phi3_eos_list_from_generation_config_stops_generation(tiny_phi3, default_gguf, tmp_path):
    """Phi-3 ships eos_token_id as a list in generation_config.json (<|endoftext|>, <|assistant|>, <|end|>):
    every id in it stops a sequence, as in transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    prompt = SHORT[1]
    free = generate(tiny_phi3, default_gguf, [prompt], max_model_len=ORIG)[0]
    stops = [free[9], free[5]]  # both occur; the one at index 5 comes first
    folder = tmp_path / "phi3"
    shutil.copytree(tiny_phi3, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *stops]}))
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    llm = LLM(str(folder), dtype="float32", max_model_len=ORIG)
    assert {2, *stops} <= set(llm.get_tokenizer().stop_token_ids)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)[0].outputs[0]
    first = min(free.index(s) for s in (2, *stops) if s in free)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"


def test_phi3_rope_factors_of_the_wrong_length_are_refused(tiny_phi3, tmp_path):
    rope = json.loads((Path(tiny_phi3) / "config.json").read_text())["rope_parameters"]
    folder = variant(tiny_phi3, tmp_path / "bad", rope_parameters=rope | {"long_factor": rope["long_factor"][:-1]})
    with pytest.raises(ModelFileError, match="long_factor has 5 values; the rotary dims need 6"):
        LLM(folder)


def test_gguf_with_one_rope_factor_tensor_is_refused(tiny_phi3, tmp_path):
    from pagoda.model.loader import resolve_model_files

    path = write_phi3_gguf(Path(tiny_phi3), tmp_path / "bad.gguf", leave_out="rope_factors_short.weight")
    with pytest.raises(ModelFileError, match="rope_factors_long.weight without its pair"):
        resolve_model_files(str(path))


def test_other_phi_architectures_are_refused_by_name(tiny_phi3, default_gguf, tmp_path):
    folder = with_architecture(tiny_phi3, tmp_path / "small", "Phi3SmallForCausalLM")
    with pytest.raises(ValueError, match="unsupported architecture 'Phi3SmallForCausalLM'.*Phi3ForCausalLM"):
        LLM(folder, tokenizer=default_gguf)


def test_tiny_phi3_parallel_samples_equal_each_sample_alone(tiny_phi3, default_gguf):
    llm = LLM(tiny_phi3, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=32)
    together, alone = seeded_samples_and_singles(llm, LONG[:2])
    assert together == alone
    assert any(len({tuple(s) for s in samples}) > 1 for samples in together)
