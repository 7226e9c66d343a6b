"""Structured outputs in the engine: every output matches its constraint, under sampling, n > 1, preemption,
prefix caching and speculation; unconstrained rows beside constrained ones are bit-identical to running
alone; the mask is the backend's own."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda import LLM, SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"]},
}, "required": ["name", "age", "pets", "address"]}
PROMPTS = ["Describe a person as JSON:", "Here is a record:", "Output:", "The capital of France is"]


def _params(constraint: dict | None, **kw) -> SamplingParams:  # noqa: ANN003
    defaults = {"max_tokens": 96, "temperature": 0.8, "seed": 3}
    return SamplingParams(**{**defaults, **kw}, structured_outputs=constraint)


def _texts(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_outputs_validate_under_sampling_and_n(smollm_llm: LLM) -> None:
    outs = smollm_llm.generate(PROMPTS, _params({"json": PERSON}, n=3), use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)


# (constraint, check of a finished output), shared with the llguidance backend's tests.
CONSTRAINT_CHECKS = [
    ({"regex": r"[A-Z][a-z]{2,6} \d{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} \d{2}", t)),
    ({"choice": ["red", "green", "dark blue", "a.b (c)"]}, lambda t: t in ["red", "green", "dark blue", "a.b (c)"]),
    ({"grammar": 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?'},
     lambda t: re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?", t)),
    ({"grammar": 'start: WORD ("," WORD)~1..3\nWORD: /[a-z]{1,8}/'},
     lambda t: re.fullmatch(r"[a-z]{1,8}(,[a-z]{1,8}){1,3}", t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
]


def assert_outputs_match(llm: LLM, prompts: list[str], constraint: dict, check) -> None:  # noqa: ANN001
    for out in llm.generate(prompts, _params(constraint, n=2, max_tokens=64), use_tqdm=False):
        for c in out.outputs:
            if c.finish_reason == "length":  # an open JSON object may run long: it is still one so far
                assert "json_object" in constraint and c.text.lstrip().startswith("{"), c.text
                continue
            assert c.finish_reason == "stop" and check(c.text), (constraint, c.text)


@pytest.mark.parametrize("constraint, check", CONSTRAINT_CHECKS)
def test_regex_choice_grammar_and_json_object_outputs_match(smollm_llm: LLM, constraint: dict, check) -> None:  # noqa: ANN001
    assert_outputs_match(smollm_llm, PROMPTS, constraint, check)


def test_unconstrained_rows_are_bit_identical_beside_constrained_ones(smollm_llm: LLM) -> None:
    free = [_params(None, temperature=0.0, max_tokens=24, ignore_eos=True),
            _params(None, temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)]
    alone = smollm_llm.generate(PROMPTS[:2], free, use_tqdm=False)
    mixed = smollm_llm.generate(PROMPTS[:2] + PROMPTS[2:], free + [_params({"json": PERSON})] * 2, use_tqdm=False)
    for a, m in zip(alone, mixed[:2]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        assert a.outputs[0].text == m.outputs[0].text


def test_mask_equals_the_backends_own(smollm_llm: LLM) -> None:
    import xgrammar as xgr

    manager = smollm_llm.engine.structured
    compiled = manager.compile(StructuredOutputsParams(json=PERSON)).result()
    ours, theirs = manager.matcher(compiled), xgr.GrammarMatcher(compiled.grammar)
    vocab = smollm_llm.engine.args.vocab_size
    for token in smollm_llm.engine.tokenizer.encode('{"name": "Al', add_special_tokens=False):
        logits = torch.randn(3, vocab)
        expected = logits[1].clone()
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        theirs.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(expected.unsqueeze(0), bitmask)
        before = logits.clone()
        manager.mask_logits(logits, [1], [ours])
        assert torch.equal(logits[1], expected)
        assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
        assert ours.accept(token) and theirs.accept_token(token)


def test_compiled_grammars_are_cached_by_their_text(smollm_llm: LLM) -> None:
    manager = smollm_llm.engine.structured
    a = manager.compile(StructuredOutputsParams(json=dict(PERSON)))
    b = manager.compile(StructuredOutputsParams(json=json.dumps(PERSON, separators=(",", ":"))))
    assert a is b


def test_bad_constraints_are_value_errors_naming_the_reason(smollm_llm: LLM) -> None:
    for bad, why in [({"regex": "("}, "parenthesis"), ({"json": {"type": "objectx"}}, "objectx"),
                     ({"grammar": "root ::= x"}, "not defined"), ({"json": "{nope"}, "JSON")]:
        with pytest.raises(ValueError, match=why):
            smollm_llm.generate(["x"], _params(bad), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert not smollm_llm.engine.has_unfinished_requests()


def test_constraints_survive_preemption_prefix_caching_and_speculation() -> None:
    """Greedy constrained outputs equal those of a roomy engine when the pool is small enough to preempt,
    when the prompt comes from the prefix cache, and with n-gram speculation on."""
    prompts = [f"Person number {i}, described as JSON:" for i in range(6)]
    greedy = _params({"json": PERSON}, temperature=0.0)
    reference = _texts(LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=512), prompts, greedy)
    tight = LLM(dtype="float32", kv_cache_memory="6MiB", max_model_len=512, max_num_seqs=6)
    assert _texts(tight, prompts, greedy) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    assert _texts(tight, prompts, greedy) == reference  # again, prompts now served from the prefix cache
    spec = LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert _texts(spec, prompts, greedy) == reference


_leaf = st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b", "c"]},
                         {"type": "string", "maxLength": 8}, {"type": "number"}])
_schema = st.recursive(_leaf, lambda inner: st.one_of(
    st.dictionaries(st.sampled_from(["x", "y", "z", "w"]), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)}),
    inner.map(lambda item: {"type": "array", "items": item, "minItems": 1, "maxItems": 2})), max_leaves=5)


@pytest.mark.long
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schema, seed=st.integers(0, 2**16))
def test_any_generated_schema_gives_valid_output(smollm_llm: LLM, schema: dict, seed: int) -> None:
    (out,) = smollm_llm.generate(["JSON:"], _params({"json": schema}, seed=seed, max_tokens=160), use_tqdm=False)
    c = out.outputs[0]
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.text), schema)
    else:  # ran out of tokens: what there is must still be a prefix the grammar allows (never invalid)
        assert c.finish_reason == "length"


def test_a_constraint_no_token_can_continue_fails_that_request_alone(smollm_llm: LLM) -> None:
    """U+B4632 is spelled by no token of SmolLM2's vocabulary: after '_' the grammar allows nothing."""
    params = [_params({"choice": ["_\U000b4632t"]}, max_tokens=8), _params(None, temperature=0.0, max_tokens=8)]
    dead, free = smollm_llm.generate(["x", "The capital of France is"], params, use_tqdm=False)
    assert dead.outputs[0].finish_reason == "error" and dead.error_status == 400 and "no next token" in dead.error
    assert free.error is None and len(free.outputs[0].token_ids) == 8


def test_a_complete_constraint_ends_even_below_min_tokens(smollm_llm: LLM) -> None:
    (out,) = smollm_llm.generate(["Answer:"], _params({"choice": ["yes", "no"]}, min_tokens=6, max_tokens=8),
                                 use_tqdm=False)
    assert out.error is None and out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


@pytest.mark.long
def test_bench_structured_reports_both_runs(tmp_path) -> None:
    from pagoda.entrypoints.cli import main

    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "--dtype", "float32", "--num-prompts", "4", "--concurrency", "4",
                 "--max-tokens", "24", "--kv-cache-memory", "64MiB", "--jump-forward-rounds", "1",
                 "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["concurrency"] == 4 and run["output_tokens"] > 0 and run["ratio"] > 0
    assert run["mask_ms_per_step"] > 0 and report["compile_ms"]["cached"] < report["compile_ms"]["new_schema"]
    jf = report["jump_forward"]
    assert jf["valid_on"] and jf["valid_off"] and jf["speedup"] > 0


@pytest.mark.parametrize("max_tokens", [5, 200])
def test_jump_forward_appends_forced_text_within_max_tokens(smollm_llm: LLM, max_tokens: int) -> None:
    stats = smollm_llm.engine.structured.stats
    before = stats.jump_forward_tokens
    (out,) = smollm_llm.generate(["A person as JSON:"], _params({"json": PERSON}, temperature=0.0,
                                                                max_tokens=max_tokens), use_tqdm=False)
    c = out.outputs[0]
    assert stats.jump_forward_tokens > before and len(c.token_ids) <= max_tokens
    if max_tokens == 200:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)
        tok = smollm_llm.engine.tokenizer
        # The forced keys are tokenized as the model's tokenizer does, not spelled out piece by piece.
        assert tok.encode('"name"', add_special_tokens=False)[1:-1][0] in c.token_ids


def test_jump_forward_off_still_matches() -> None:
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, structured_outputs_jump_forward=False)
    (out,) = llm.generate(["A person as JSON:"], _params({"json": PERSON}, temperature=0.0, max_tokens=200),
                          use_tqdm=False)
    assert llm.engine.structured.stats.jump_forward_tokens == 0
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
