"""Tool calling through `pagoda serve` and the official openai client: tool_choice required, a named
function and auto, streamed and not, on both grammar backends; the assembled arguments parse and validate
against the function's parameters; a conversation with earlier calls and tool results goes back through the
template; bad tool requests are 400s."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.e2e.conftest import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# An earlier question the assistant answered with a call: a 135M model then calls one under "auto" too.
SHOT = [{"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
        {"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _server(*args: str) -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--max-num-seqs", "8", *args) as srv:
        yield srv


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def client(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    for srv in _server("--structured-outputs-backend", request.param):
        yield srv.openai(timeout=300)


def _check(calls: list[tuple[str, str]], expect: str | None = None) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert expect is None or name == expect
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _create(client: openai.OpenAI, stream: bool, **kw) -> tuple[list[tuple[str, str]], str | None, str | None]:  # noqa: ANN003
    """(calls as (name, arguments), content, finish_reason), assembled from the stream when streaming."""
    kw = {"model": MODEL, "tools": TOOLS, "max_tokens": 120, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    parts: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in parts:  # the first delta of a call carries its id and name
                    assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                    parts[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                parts[d.index][1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return [(n, a) for n, a in parts.values()], content or None, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_calls_validate_under_sampling(client: openai.OpenAI, stream: bool) -> None:
    for seed in range(2):
        calls, content, finish = _create(client, stream, messages=ASK, tool_choice="required",
                                         temperature=0.8, seed=seed)
        _check(calls)
        assert finish == "tool_calls" and content is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_called(client: openai.OpenAI, stream: bool) -> None:
    calls, _, finish = _create(client, stream, messages=ASK, tool_choice=NAMED, temperature=0.8, seed=3)
    _check(calls, "get_time")
    assert len(calls) == 1 and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_calls_parse_and_validate(client: openai.OpenAI, stream: bool) -> None:
    calls, _, finish = _create(client, stream, messages=SHOT, tool_choice="auto", temperature=0)
    _check(calls, "get_weather")
    assert finish == "tool_calls"
    for seed in range(2):  # sampled: the call, if the model makes one, is constrained from its tag on
        calls, content, finish = _create(client, stream, messages=SHOT, temperature=0.8, seed=seed)
        if calls:
            _check(calls)
        else:
            assert content


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    calls, _, _ = _create(client, False, messages=ASK, tool_choice="required", parallel_tool_calls=False,
                          temperature=0.8, seed=5)
    assert len(calls) == 1
    _check(calls)


def test_a_tool_result_goes_back_through_the_template(client: openai.OpenAI) -> None:
    calls, _, _ = _create(client, False, messages=ASK, tool_choice=NAMED, temperature=0)
    (name, arguments), = calls
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "It is 14:05 there."}]
    calls, content, finish = _create(client, False, messages=history, tool_choice="none", temperature=0)
    assert content and not calls and finish in ("stop", "length")
    tokens = client.post("/../tokenize", body={"model": MODEL, "messages": history}, cast_to=object)
    assert tokens["count"] > 0


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(["}}}}}], "tool_choice": "required"}, None),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400s(client: openai.OpenAI, kw: dict, param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 8, **kw})
    assert e.value.status_code == 400
    if param:
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
