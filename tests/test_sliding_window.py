"""Sliding-window attention end to end: a tiny Mistral whose window (7) is shorter than the test prompts
generates HF transformers' greedy tokens in fp32, and the KV blocks out of the window are freed as it goes."""
from __future__ import annotations

import pytest
import torch
from tiny_models import (
    build_tiny_model,
    greedy_tokens,
    hf_greedy,
    seeded_samples_and_singles,
    worst_prompt_logprob_error,
)

from pagoda import LLM, SamplingParams
from pagoda.core.kv_cache_manager import FREED

WINDOW = 7
PROMPTS = [[5, 17, 99, 3, 250], list(range(10, 47)), [7], list(range(100, 300, 3)), [400, 401, 402, 11, 12, 13]]


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False, sliding_window=WINDOW)
    path = tmp_path_factory.mktemp("tiny_mistral")
    MistralForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_windowed(model_dir: str, window: int | None = WINDOW) -> list[list[int]]:
    """transformers' greedy tokens on PROMPTS with its config's sliding_window set to `window`."""
    return hf_greedy(model_dir, PROMPTS, 24, config={"sliding_window": window})


@pytest.fixture(scope="module")
def hf_tokens(tiny_mistral) -> list[list[int]]:
    return hf_windowed(tiny_mistral)


def generate(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS, 24)


def test_hf_itself_feels_the_window(tiny_mistral, hf_tokens):
    """The prompts are long enough that attending to every key would give other tokens."""
    assert hf_windowed(tiny_mistral, window=None) != hf_tokens


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_sliding_window_mistral_matches_hf(tiny_mistral, default_gguf, hf_tokens, kernels):
    llm = LLM(tiny_mistral, tokenizer=default_gguf, dtype="float32", kernels=kernels, kv_cache_memory="16MiB")
    assert llm.engine.kv.sliding_window == WINDOW
    assert generate(llm) == hf_tokens
    assert generate(llm) == hf_tokens  # again, through the prefix cache


def test_sliding_window_with_chunked_prefill_small_blocks_and_preemption(tiny_mistral, default_gguf, hf_tokens):
    # 10 blocks of 4 tokens hold the window of a few sequences only: some are preempted and recomputed.
    llm = LLM(tiny_mistral, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory=10 * 4 * 2 * 2 * 2 * 16 * 4)
    assert llm.engine.kv.pool.num_blocks == 10
    assert generate(llm) == hf_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.pool.num_free == 10


def test_blocks_out_of_the_window_are_freed_as_a_sequence_grows(tiny_mistral, default_gguf):
    llm = LLM(tiny_mistral, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request(list(range(10, 50)), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    held, freed = [], []
    while engine.has_unfinished_requests():
        engine.step()
        held += [sum(b != FREED for b in table) for table in engine.kv.block_tables.values()]
        freed += [table.count(FREED) for table in engine.kv.block_tables.values()]
    # 190 tokens would be 48 blocks; the window (7) plus one token needs at most 3 blocks of 4 once decoding.
    assert max(held[-100:]) <= 3
    assert max(held) <= engine.kv.max_blocks_held(190, 16)
    assert max(freed) > 40
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_bf16_runs_with_a_window(tiny_mistral, default_gguf, hf_tokens):
    llm = LLM(tiny_mistral, tokenizer=default_gguf, dtype="bfloat16", kv_cache_memory="16MiB")
    out = generate(llm)
    # bf16 rounds differently from HF's fp32; most tokens still agree on a random model.
    same = sum(a == b for x, y in zip(out, hf_tokens) for a, b in zip(x, y))
    assert same >= 0.5 * sum(len(x) for x in hf_tokens)


def test_qwen2_with_window_layers_and_global_layers_matches_hf(tmp_path, default_gguf):
    """Qwen2's use_sliding_window with max_window_layers: layer 0 global, layer 1 windowed (transformers'
    layer_types). Nothing is freed (the global layer reads every key), and tokens equal HF's."""
    path = str(build_tiny_model(tmp_path / "q2", "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                                max_window_layers=1))
    llm = LLM(path, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.args.layer_windows == [0, WINDOW] and llm.engine.kv.sliding_window is None
    assert generate(llm) == hf_windowed(path)
    # The same weights (same seed) with every layer global give other tokens: the window is felt.
    plain = str(build_tiny_model(tmp_path / "q2-global", "qwen2"))
    assert hf_windowed(plain) != hf_windowed(path)


def test_parallel_samples_with_a_window_equal_each_sample_alone(tiny_mistral, default_gguf):
    """n > 1 siblings fork onto the prompt's blocks, and each frees its own references as the window moves on
    (block_size 4: the shared prompt blocks leave the window within a few tokens)."""
    llm = LLM(tiny_mistral, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=16)
    together, alone = seeded_samples_and_singles(llm, PROMPTS[:4], max_new=24)
    assert together == alone
    assert any(len({tuple(s) for s in samples}) > 1 for samples in together)  # the samples differ
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_sliding_window_prompt_logprobs_match_hf(tiny_mistral, default_gguf, kernels):
    """A 67-token prompt in chunks of 16 over blocks of 4: most positions see a window that starts past the first
    block. fp32 on both sides, float rounding only (measured a few 1e-6); attending to every key moves these
    logprobs by units."""
    prompt = PROMPTS[3]
    llm = LLM(tiny_mistral, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=16,
              kernels=kernels)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert worst_prompt_logprob_error(tiny_mistral, prompt, out.prompt_logprobs) < 1e-4
