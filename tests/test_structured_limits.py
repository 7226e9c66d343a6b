"""Constraints that would run a grammar library without end: refused before any compiler sees them, or decoded
without the unbounded jump-forward search; the engine stays responsive either way."""
from __future__ import annotations

import json
import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda import LLM, SamplingParams
from pagoda.structured.limits import MAX_SCHEMA_DEPTH, json_schema_sizes

RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}
HUGE_ARRAY = {"type": "array", "items": {"const": "a"}, "minItems": 10**9}


# ---- the sizes ---------------------------------------------------------------------------------------
def test_a_required_self_reference_has_no_finite_instance() -> None:
    assert json_schema_sizes(RECURSIVE).shortest == math.inf
    mutual = {"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 1},
                        "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
    assert json_schema_sizes(mutual).shortest == math.inf


def test_a_way_out_of_a_cycle_is_found() -> None:
    optional = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    assert json_schema_sizes(optional) == json_schema_sizes({"type": "object"})  # {} and nothing longer
    # a -> b -> a, with null as a's way out: b is {"a":null}, the root {"x":null,"y":{"a":null}}
    tree = {"$defs": {"a": {"anyOf": [{"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                                       "required": ["b"]}, {"type": "null"}]},
                      "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
            "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"$ref": "#/$defs/b"}},
            "required": ["x", "y"]}
    assert json_schema_sizes(tree).shortest == len('{"x":null,"y":{"a":null}}')


def test_minimums_count() -> None:
    assert json_schema_sizes(HUGE_ARRAY).shortest == 2 + 10**9 * 3 + (10**9 - 1)
    person = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    assert json_schema_sizes(person).shortest == len('{"name":"abc","age":1}')
    assert json_schema_sizes({"enum": ["long one", "x"]}).shortest == len('"x"')


def test_a_schema_nested_too_deep_is_refused() -> None:
    deep: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH + 2):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper"):
        json_schema_sizes(deep)


_schemas = st.recursive(
    st.sampled_from([{"type": "integer"}, {"type": "string"}, {"type": "null"}, {"const": "k"}, {"$ref": "#/$defs/d"}]),
    lambda inner: st.one_of(
        st.builds(lambda p, req: {"type": "object", "properties": {"p": p}, **({"required": ["p"]} if req else {})},
                  inner, st.booleans()),
        st.builds(lambda i, n: {"type": "array", "items": i, "minItems": n}, inner, st.integers(0, 3)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)),
    max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(_schemas, _schemas)
def test_sizes_never_exceed_a_real_instance(root: dict, d: dict) -> None:
    """The shortest size is a lower bound: it is never more than the length of an instance built from it."""
    schema = {**root, "$defs": {"d": d}}
    n = json_schema_sizes(schema).shortest
    inst = _build(schema, schema, 0)
    if inst is not _MISSING:
        assert n <= len(json.dumps(inst, separators=(",", ":")))


_MISSING = object()  # no instance found


def _build(s: dict, root: dict, depth: int):  # noqa: ANN202 - any JSON value, or _MISSING
    """Some instance of `s` (the first way out at each choice), or _MISSING if none within a few levels."""
    if depth > 12:
        return _MISSING
    if "$ref" in s:
        return _build(root["$defs"]["d"], root, depth + 1)
    if "const" in s:
        return s["const"]
    if "anyOf" in s:
        return next((v for v in (_build(b, root, depth + 1) for b in s["anyOf"]) if v is not _MISSING), _MISSING)
    t = s.get("type")
    if t == "object":
        if "p" not in s.get("required", []):
            return {}
        v = _build(s["properties"]["p"], root, depth + 1)
        return _MISSING if v is _MISSING else {"p": v}
    if t == "array":
        items = [_build(s["items"], root, depth + 1) for _ in range(s.get("minItems", 0))]
        return _MISSING if any(i is _MISSING for i in items) else items
    return {"integer": 1, "string": "", "null": None}[t]


# ---- through the engine ------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema, reason", [(RECURSIVE, "has no finite instance"),
                                            (HUGE_ARRAY, "needs at least 4000000001 characters")])
def test_a_schema_no_output_can_finish_is_refused_before_compiling(smollm_llm: LLM, schema: dict,
                                                                    reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        smollm_llm.generate("x", SamplingParams(max_tokens=8, structured_outputs={"json": schema}), use_tqdm=False)


@pytest.mark.parametrize("constraint", [{"grammar": 'root ::= "a" root'}, {"regex": "(ab){1000000000}"}])
def test_a_grammar_forcing_text_without_end_decodes_to_max_tokens(smollm_llm: LLM, constraint: dict) -> None:
    """xgrammar's jump-forward search would follow these forever: it is off for user grammars and regexes."""
    result: list = []
    t = threading.Thread(target=lambda: result.append(smollm_llm.generate(
        "x", SamplingParams(max_tokens=6, temperature=0, structured_outputs=constraint), use_tqdm=False)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "generation did not return"
    out = result[0][0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
