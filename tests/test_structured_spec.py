"""Structured outputs with speculative decoding: proposals the grammar forbids are cut before verification,
the target is masked by the grammar at every proposed position, and matchers advance over every emitted
token. Greedy outputs equal decoding without speculation token for token; sampled ones still match."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.core.request import Sequence
from pagoda.spec_decode.speculator import _grammar_prefix
from pagoda.structured.params import StructuredOutputsParams

REPEAT = r"((tick|tock), ){8}done"  # not forced, and repetitive: n-gram proposals find it
ROW = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "ok": {"type": "boolean"}}, "required": ["id", "ok"]}
TABLE = {"type": "array", "items": ROW, "minItems": 4, "maxItems": 4}
CONSTRAINTS = [{"regex": REPEAT}, {"json": TABLE}, {"choice": ["alpha beta alpha beta", "gamma"]}]
PROMPTS = ["A clock says:", "Four rows of a table as JSON:", "Pick one:"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def _llm(**kw) -> LLM:  # noqa: ANN003
    return LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=512, **kw)


def _run(llm: LLM, params: list[SamplingParams]) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _params(temperature: float, **kw) -> list[SamplingParams]:  # noqa: ANN003
    return [SamplingParams(max_tokens=80, temperature=temperature, seed=7, structured_outputs=c, **kw)
            for c in CONSTRAINTS]


@pytest.fixture(scope="module")
def reference() -> list[list[str]]:
    return _run(_llm(), _params(0.0))


@pytest.mark.parametrize("spec", [NGRAM, {"method": "self", "num_draft_layers": 8, "num_speculative_tokens": 3,
                                          "adaptive": False}], ids=["ngram", "self-draft"])
def test_greedy_constrained_outputs_equal_decoding_without_speculation(reference: list[list[str]],
                                                                       spec: dict) -> None:
    llm = _llm(speculative_config=spec)
    assert _run(llm, _params(0.0)) == reference
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0, stats  # constrained rows were speculated on


def test_sampled_constrained_outputs_match_with_speculation() -> None:
    llm = _llm(speculative_config=NGRAM)
    for seed in range(3):
        params = [SamplingParams(max_tokens=120, temperature=0.8, seed=seed, n=2, structured_outputs=c)
                  for c in CONSTRAINTS]
        clock, table, choice = _run(llm, params)
        assert all(re.fullmatch(REPEAT, t) for t in clock), clock
        for t in table:
            jsonschema.validate(json.loads(t), TABLE)
        assert all(t in CONSTRAINTS[2]["choice"] for t in choice), choice
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


def test_proposals_the_grammar_forbids_are_cut(smollm_llm: LLM) -> None:
    engine = smollm_llm.engine
    tok = engine.tokenizer
    grammar = engine.structured.compile(StructuredOutputsParams(regex="(ab)+c")).result()
    seq = Sequence.__new__(Sequence)
    seq.matcher = engine.structured.matcher(grammar)
    ab = tok.encode("ab", add_special_tokens=False)
    x = tok.encode("x", add_special_tokens=False)
    assert _grammar_prefix(seq, ab + ab + x + ab) == ab + ab
    assert _grammar_prefix(seq, x + ab) == []
    assert seq.matcher.accept(x[0]) is False and seq.matcher.accept(ab[0])  # the matcher itself did not move
