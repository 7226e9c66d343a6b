"""Prefix caching: identical greedy outputs with and without it, and hits that really skip compute."""
from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = list(range(30, 90))  # a 60-token shared "system prompt" (not block aligned at block_size 16)


@pytest.fixture(scope="module")
def pair(tiny_llama, default_gguf):
    kw = dict(tokenizer=default_gguf, dtype="float32", block_size=16)
    return (LLM(tiny_llama, enable_prefix_caching=True, **kw), LLM(tiny_llama, enable_prefix_caching=False, **kw))


def both(pair, prompts, params=GREEDY):
    on, off = pair
    a = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    return a, b


def test_shared_system_prompt_gives_identical_outputs(pair):
    prompts = [SYSTEM + [200 + i, 201, 202 + i] for i in range(6)]
    a, b = both(pair, prompts)
    assert a == b
    a2, b2 = both(pair, prompts)  # second pass: everything but the tails hits
    assert a2 == a and b2 == b


def test_multi_turn_replay_and_unaligned_and_full_hit_prompts(pair):
    on, _ = pair
    history = [1, 2, 3]
    for turn in range(4):
        history = history + [300 + turn] * 5
        a, b = both(pair, [history])
        assert a == b
        history = history + a[0]
    # a prompt that is exactly a cached run of full blocks, and one sharing an unaligned prefix
    full = SYSTEM[:48]
    assert both(pair, [full])[0] == both(pair, [full])[1]
    assert both(pair, [full])[0] == both(pair, [full])[1]
    unaligned = SYSTEM[:37] + [5, 6]
    a, b = both(pair, [unaligned])
    assert a == b


def test_second_run_schedules_only_the_uncached_tokens(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", block_size=16)
    eng = llm.engine
    prompt = list(range(10, 10 + 100))  # 6 full blocks + 4 tokens
    params = SamplingParams(temperature=0, max_tokens=1)
    before = eng.stats.num_scheduled_tokens
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    cold = eng.stats.num_scheduled_tokens - before
    before = eng.stats.num_scheduled_tokens
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    warm = eng.stats.num_scheduled_tokens - before
    assert cold == 100 and first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96 and warm == 4
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert eng.kv.stats.hits == 96 and eng.kv.stats.queries == 200
    # a different salt, and a reset cache, see no hits
    salted = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant"}], params, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0
    llm.reset_prefix_cache()
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_prefix_caching_with_preemption_and_parallel_sampling(tiny_llama, default_gguf):
    kw = dict(tokenizer=default_gguf, dtype="float32", block_size=4, kv_cache_memory=24 * 2048)
    prompts = [SYSTEM[:30] + [i] for i in range(5)]
    params = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)
    on = LLM(tiny_llama, enable_prefix_caching=True, **kw)
    off = LLM(tiny_llama, enable_prefix_caching=False, **kw)
    a = [[c.token_ids for c in o.outputs] for o in on.generate(prompts, params, use_tqdm=False)]
    b = [[c.token_ids for c in o.outputs] for o in off.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert on.engine.scheduler.num_preemptions > 0
    assert on.engine.kv.pool.num_free == on.engine.kv.pool.num_blocks
