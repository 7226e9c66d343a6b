"""POST /v1/messages through the official `anthropic` SDK: the same tokens as /v1/chat/completions at greedy,
streamed as Anthropic's events, a tool round trip, count_tokens, the key as x-api-key, and errors in
Anthropic's shape."""
from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

KEY = "messages-test-key"
GREEDY = {"temperature": 0}  # the SDK no longer takes temperature as an argument; the API still reads it
SYSTEM = "You are a terse assistant."
ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--api-key", KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_a_message_is_the_chat_routes_tokens(server: ServerProcess, claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model=MODEL_NAME, system=SYSTEM, messages=ASK, max_tokens=24,
                                 extra_body=GREEDY)
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    count = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=ASK)
    assert count.input_tokens == msg.usage.input_tokens


def test_a_streamed_message_has_anthropics_events_and_the_same_text(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL_NAME, messages=ASK, max_tokens=16, extra_body=GREEDY)
    kinds = []
    with claude.messages.stream(model=MODEL_NAME, messages=ASK, max_tokens=16, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_round_trip(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = {"type": "tool", "name": "get_weather"}
    msg = claude.messages.create(model=MODEL_NAME, messages=ask, tools=[WEATHER], tool_choice=forced,
                                 max_tokens=64, extra_body=GREEDY)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str)
    with claude.messages.stream(model=MODEL_NAME, messages=ask, tools=[WEATHER], tool_choice=forced, max_tokens=64,
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    follow = [*ask, {"role": "assistant", "content": msg.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                            "content": json.dumps({"sky": "clear", "celsius": 4})}]}]
    answer = claude.messages.create(model=MODEL_NAME, messages=follow, tools=[WEATHER], max_tokens=32,
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_errors_come_in_anthropics_shape(server: ServerProcess, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL_NAME, messages=[{"role": "system", "content": "x"}], max_tokens=4)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # max_tokens is required
        claude.post("/v1/messages", body={"model": MODEL_NAME, "messages": ASK}, cast_to=dict)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, messages=ASK, max_tokens=4)
