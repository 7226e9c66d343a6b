"""POST /v1/responses through the official `openai` SDK: the same tokens as /v1/chat/completions at greedy,
streamed as the documented response.* events, structured output through text.format, a function-calling
round trip continued with previous_response_id, and GET/DELETE of a stored response."""
from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

ASK = "Name three colors."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    srv = ServerProcess("--kv-cache-memory", "128MiB", "--max-model-len", "1024")
    try:
        srv.wait_ready()
        yield srv.openai()
    finally:
        srv.stop()


def test_a_response_is_the_chat_routes_tokens(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL_NAME, instructions="Be terse.", input=ASK, max_output_tokens=24,
                                   temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": ASK}])
    assert resp.object == "response" and resp.id.startswith("resp")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_a_streamed_response_has_the_documented_events_and_the_same_text(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=16, temperature=0)
    kinds, deltas, final = [], [], None
    for event in client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=16, temperature=0,
                                         stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.output_item.done"} <= set(kinds)
    assert "".join(deltas) == whole.output_text and final is not None and final.output_text == whole.output_text


def test_text_format_constrains_the_output(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"],
              "additionalProperties": False}
    resp = client.responses.create(model=MODEL_NAME, input="Pick a color.", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert isinstance(json.loads(resp.output_text)["color"], str)


def test_a_function_call_round_trip_with_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="What is the weather in Oslo?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    streamed = [e for e in client.responses.create(
        model=MODEL_NAME, input="What is the weather in Oslo?", tools=[WEATHER], max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0, stream=True)]
    done = [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done == [calls[0].arguments]
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, tools=[WEATHER],
                                     max_output_tokens=24, temperature=0, input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": json.dumps({"sky": "clear", "celsius": 4})}])
    assert second.previous_response_id == first.id and second.output
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, previous_response_id="resp-none", input="hi", max_output_tokens=4)
