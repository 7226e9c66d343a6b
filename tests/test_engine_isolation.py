"""A failure inside an engine step fails the request it belongs to, or the step's requests, never the engine;
SamplingParams and add_request reject what the engine cannot run."""
from __future__ import annotations

import math

import pytest

from pagoda import SamplingParams
from pagoda.engine.engine import LLMEngine
from pagoda.layers.sampler import Sampler

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Hello, my name is"]
N_TOKENS = 12


def _run(engine: LLMEngine, prompts: dict[str, str], params: SamplingParams) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params, rid)
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finals


@pytest.fixture
def engine(smollm_llm) -> LLMEngine:
    eng = smollm_llm.engine
    assert not eng.has_unfinished_requests()
    yield eng
    for rid in list(eng.requests):
        eng.abort_request(rid)
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks  # no leaked block


def _innocents() -> dict[str, str]:
    return {f"ok{i}": p for i, p in enumerate(PROMPTS)}


def _reference(engine: LLMEngine, params: SamplingParams) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in _run(engine, _innocents(), params).items()}


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_output_processing_failure_fails_that_request_alone(engine: LLMEngine, monkeypatch, seeded: bool) -> None:
    params = SamplingParams(temperature=0.8 if seeded else 0.0, seed=7 if seeded else None, max_tokens=N_TOKENS,
                            ignore_eos=True)
    ref = _reference(engine, params)
    original = engine.outputs._append  # one row's output processing

    def flaky(seq, *args):  # noqa: ANN001, ANN002, ANN202
        if seq.request.request_id == "bad" and seq.num_output_tokens >= 3:
            raise RuntimeError("injected detokenizer failure")
        return original(seq, *args)

    monkeypatch.setattr(engine.outputs, "_append", flaky)
    finals = _run(engine, {**_innocents(), "bad": "A request that fails"}, params)
    bad = finals.pop("bad")
    assert bad.error and bad.outputs[0].finish_reason == "error"
    assert "injected" not in bad.error  # no internals in what a client sees
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == ref
    assert all(out.error is None and out.outputs[0].finish_reason == "length" for out in finals.values())


def test_sampling_failure_in_one_row_fails_that_request_alone(engine: LLMEngine, monkeypatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    ref = _reference(engine, params)
    bad_params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, min_p=0.5)
    real = Sampler.__call__

    def poisoned(self, logits, batch):  # noqa: ANN001, ANN202 - a row the batched sampler cannot handle
        if any(p is bad_params for p in batch.params):
            raise IndexError("injected sampler failure")
        return real(self, logits, batch)

    monkeypatch.setattr(Sampler, "__call__", poisoned)
    engine.add_request("A request whose sampling fails", bad_params, "bad")
    finals = _run(engine, _innocents(), params)
    assert finals.pop("bad").outputs[0].finish_reason == "error"
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == ref


def test_unattributable_failure_fails_the_step_and_the_engine_goes_on(engine: LLMEngine, monkeypatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    real = engine.runner.execute
    calls = {"n": 0}

    def once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", once)
    finals = _run(engine, _innocents(), params)
    assert {out.outputs[0].finish_reason for out in finals.values()} == {"error"}
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    # The engine serves the next requests normally.
    after = _run(engine, {"next": PROMPTS[0]}, params)
    assert after["next"].outputs[0].finish_reason == "length" and len(after["next"].outputs[0].token_ids) == N_TOKENS


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": math.inf}, "min_p"),
    ({"presence_penalty": -math.inf}, "presence_penalty"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": 10**20}, "top_k"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"n": 1.5}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
])
def test_sampling_params_reject_what_no_engine_can_run(kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),
    ({"n": 10_000}, "max_num_seqs"),
    ({"logprobs": 10**7}, "logprobs"),
    ({"prompt_logprobs": 10**7}, "prompt_logprobs"),
])
def test_add_request_rejects_values_beyond_this_model(engine: LLMEngine, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.add_request("hi", SamplingParams(**kwargs))
    assert not engine.has_unfinished_requests()


def test_extreme_but_valid_values_run(engine: LLMEngine) -> None:
    """Values at the edges of the ranges are served, not crashed on: top_k beyond the vocabulary, the largest
    int64 seed with n=2, a huge finite temperature."""
    params = SamplingParams(top_k=2**62, seed=2**63 - 1, n=2, temperature=1e300, max_tokens=3, ignore_eos=True)
    out = _run(engine, {"edge": "hi"}, params)["edge"]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3] and out.error is None


def test_huge_prompt_is_refused_before_tokenization(engine: LLMEngine, monkeypatch) -> None:
    def boom(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(engine.tokenizer, "encode", boom)
    with pytest.raises(ValueError, match="too long"):
        engine.add_request("x" * (engine.max_model_len * engine.tokenizer.max_token_bytes * 2 + 1))
    with pytest.raises(ValueError, match="too long"):
        engine.input_processor.tokenize_chat([{"role": "user", "content": "y" * 10**8}])
