"""Tool calling without a model: validating tools, the constraints a choice imposes, reading each format's
calls whole and streamed (every chunking of the text gives the same calls), and the conversation the
template sees."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagoda.tools import choose_format, parse_tools, plan_tools, prepare_conversation, template_reads_tools
from pagoda.tools.formats import HERMES, LLAMA3_JSON, MISTRAL
from pagoda.tools.parser import ArgumentsReader, ArrayReader, ToolCallStream, parse_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# (reader, text, expected content, expected [(name, arguments)])
CASES = [
    (HERMES.reader, 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}{", "n": [1, '
                    '{"a": "\\"}"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Checking.", [("get_weather", '{"city": "Paris}{", "n": [1, {"a": "\\"}"}]}'), ("get_time", "{}")]),
    (HERMES.reader, "no call here, only < and <tool", "no call here, only < and <tool", []),
    (HERMES.reader, '<tool_call>\n{"name": "f", "arguments": oops}\n</tool_call> after',
     '<tool_call>\n{"name": "f", "arguments": oops}\n</tool_call> after', []),
    (HERMES.reader, '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>', None, [("f", '{"x": 1}')]),
    (HERMES.reader, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),  # EOS, no close
    (HERMES.reader, '<tool_call>\n{"name": "f", "arguments": {"x": 1',
     '<tool_call>\n{"name": "f", "arguments": {"x": 1', []),  # cut by max_tokens: given back as text
    (LLAMA3_JSON.reader, '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "a;b"}}', None,
     [("f", '{"x": 1}'), ("g", '{"y": "a;b"}')]),
    (LLAMA3_JSON.reader, '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", "{}")]),
    (LLAMA3_JSON.reader, "Just {text} with braces.", "Just {text} with braces.", []),
    (MISTRAL.reader, 'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     "Sure", [("f", '{"x": 1}'), ("g", "{}")]),
    (ArrayReader(), '[{"name": "f", "parameters": {"x": [1, 2]}}, {"name": "g", "parameters": {}}]', None,
     [("f", '{"x": [1, 2]}'), ("g", "{}")]),
    (ArgumentsReader("f"), ' {"x": {"y": "}"}}', None, [("f", '{"x": {"y": "}"}}')]),
]


@pytest.mark.parametrize("reader, text, content, calls", CASES)
def test_readers_split_content_and_calls(reader, text: str, content: str | None, calls: list) -> None:  # noqa: ANN001
    got_content, got = parse_calls(reader, text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == len(got)


def _replay(stream: ToolCallStream, text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    """Feed `text` in the pieces `cuts` makes; return the content and the calls the deltas assemble to."""
    content, calls = "", {}
    for end in sorted(set(cuts) | {len(text)}):
        delta = stream.update(text[:end], final=end == len(text))
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["function"]["name"], "id and name come first"
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert "id" not in d and "name" not in d["function"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


# Texts a grammar-constrained call never produces: a malformed call, and one cut short (by max_tokens, where
# the stream has already sent what was written, and finish_reason "length" says so).
UNCONSTRAINED_ONLY = {2, 5}


@settings(max_examples=80, deadline=None)
@given(index=st.integers(0, len(CASES) - 1), incremental=st.booleans(), data=st.data())
def test_every_chunking_of_a_stream_assembles_the_same_calls(index: int, incremental: bool, data) -> None:  # noqa: ANN001
    assume(not (incremental and index in UNCONSTRAINED_ONLY))
    reader, text, content, calls = CASES[index]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    got_content, got = _replay(ToolCallStream(reader, incremental), text, cuts)
    assert got_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in got.values()] == calls
    for c in got.values():
        json.loads(c["arguments"])


def test_streamed_arguments_go_out_as_written_only_when_constrained() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    delta = ToolCallStream(HERMES.reader, True).update(text, False)
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"city": "Par'}
    assert ToolCallStream(HERMES.reader, False).update(text, False) == {}  # may still turn out malformed


def test_content_that_may_open_a_call_is_held_back() -> None:
    stream = ToolCallStream(HERMES.reader, True)
    assert stream.update("Let me look <tool_", False) == {"content": "Let me look"}
    assert stream.update("Let me look <tool_x", False) == {"content": " <tool_x"}


def test_parallel_tool_calls_false_keeps_one_call() -> None:
    text = CASES[0][1]
    assert len(parse_calls(HERMES.reader, text, max_calls=1)[1]) == 1
    _, calls = _replay(ToolCallStream(HERMES.reader, True, max_calls=1), text, list(range(len(text))))
    assert len(calls) == 1


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "retrieval"}], None, "tools[0]: only tools of type 'function'"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "type object"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope', which is not in tools"),
    ([WEATHER], "sometimes", "tool_choice: must be"),
    (None, "required", "tool_choice: requires tools"),
])
def test_bad_tools_are_value_errors_naming_the_field(tools, choice, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_tools(tools, choice, None)


def test_a_long_tool_list_is_capped_before_it_is_read() -> None:
    from pagoda.tools.request import MAX_TOOLS

    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS)]
    assert len(parse_tools(tools, "auto", None).functions) == MAX_TOOLS
    with pytest.raises(ValueError, match=f"at most {MAX_TOOLS} tools"):
        parse_tools(tools * 60 + [None], "auto", None)  # refused by its count: the bad last tool is never read
    with pytest.raises(ValueError, match="'f0' is defined twice"):
        parse_tools(tools[:10] + tools[:1], "auto", None)


def test_required_and_named_constraints_accept_exactly_valid_calls() -> None:
    required = json.loads(parse_tools([WEATHER, TIME], "required", None).forced_constraint().json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {}}], required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = json.loads(parse_tools([WEATHER, TIME], "required", False).forced_constraint().json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(named.forced_constraint().json) == WEATHER["function"]["parameters"]
    assert parse_tools([WEATHER], "auto", None).forced_constraint() is None


def test_plans() -> None:
    tools = parse_tools([WEATHER], "auto", None)
    plan = plan_tools(tools, HERMES, None)
    tag = json.loads(plan.constraint.structural_tag)
    assert tag["triggers"] == ["<tool_call>"] and plan.constrained
    assert tag["structures"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert plan_tools(tools, MISTRAL, None).constraint is None  # [TOOL_CALLS] is a control token: read only
    assert plan_tools(parse_tools([WEATHER], "none", None), HERMES, None) is None
    own = parse_tools([WEATHER], "required", None).forced_constraint()
    assert plan_tools(tools, HERMES, own).constraint is None  # the request's own constraint stays
    with pytest.raises(ValueError, match="cannot be combined"):
        plan_tools(parse_tools([WEATHER], "required", None), HERMES, own)


def test_format_from_the_template_or_the_flag() -> None:
    assert choose_format(None, "{{ '<tool_call>' }}{% for t in tools %}") is HERMES
    assert choose_format(None, "<|start_header_id|>ipython<|end_header_id|>") is LLAMA3_JSON
    assert choose_format(None, "[AVAILABLE_TOOLS] [TOOL_CALLS]") is MISTRAL
    assert choose_format(None, "{{ message['content'] }}") is HERMES
    assert choose_format("mistral", "<tool_call>") is MISTRAL
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose_format("nope", None)
    assert template_reads_tools("{% if tools %}") and not template_reads_tools("{{ messages }}")


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "snow"},
]


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    messages, tools = prepare_conversation(HISTORY, parse_tools([WEATHER], "auto", None), HERMES, native=False)
    assert tools is None
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content":
                           "<tool_response>\n-3 C\n</tool_response>\n<tool_response>\nsnow\n</tool_response>"}
    none, _ = prepare_conversation(HISTORY, parse_tools([WEATHER], "none", None), HERMES, native=False)
    assert none[0]["content"] == "Be brief."  # tool_choice none: the tools are not offered


def test_a_template_with_tools_gets_them_and_arguments_as_objects() -> None:
    messages, tools = prepare_conversation(HISTORY, parse_tools([WEATHER], "auto", None), HERMES, native=True)
    assert tools == [WEATHER]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[3]["role"] == "tool" and messages[3]["tool_call_id"] == "call_1"


def test_malformed_history_calls_are_value_errors() -> None:
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        prepare_conversation(bad, None, HERMES, native=False)


def test_arguments_nested_past_the_json_parser_are_a_value_error() -> None:
    from pagoda.tools.formats import prepare_conversation

    deep = "[" * 100_000 + "]" * 100_000
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + deep + "}"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].*arguments: nested too deeply"):
        prepare_conversation(history, None, HERMES, native=True)
