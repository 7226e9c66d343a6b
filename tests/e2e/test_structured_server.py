"""Structured outputs through `pagoda serve` and the official openai client: response_format (Pydantic
models through client.chat.completions.parse, json_object), vLLM's structured_outputs and guided_* fields,
streamed and not; a constraint that cannot compile is a 400 while other requests finish."""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from enum import Enum
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite: Color
    address: Address


class Inventory(BaseModel):
    # Strings are bounded: a 135M model sampling at 0.8 can ramble inside an unbounded one past max_tokens.
    items: list[Annotated[str, Field(max_length=12)]] = Field(min_length=1, max_length=3)
    count: int
    note: Annotated[str, Field(max_length=20)] | None = None


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai(timeout=300)


@pytest.mark.parametrize("model", [Person, Inventory], ids=["nested-enum-pattern", "array-bounds-optional"])
def test_parse_with_a_pydantic_model_returns_valid_objects(client: openai.OpenAI, model: type[BaseModel]) -> None:
    schema = model.model_json_schema()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": f"Give me a {model.__name__} as JSON."}],
            response_format=model, temperature=0.8, seed=seed, max_tokens=200)
        message = completion.choices[0].message
        assert isinstance(message.parsed, model), message.content
        jsonschema.validate(json.loads(message.content), schema)


@pytest.mark.long
def test_json_object_streamed_assembles_to_an_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about cats, please."}],
        response_format={"type": "json_object"}, temperature=0.7, seed=1, max_tokens=300, stream=True)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and text.startswith("{")


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ({"guided_regex": r"(yes|no), because [a-z ]{1,20}\."},
     lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
    ({"structured_outputs": {"choice": ["Paris", "London", "New York"]}},
     lambda t: t in ("Paris", "London", "New York")),
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"structured_outputs": {"grammar": 'root ::= "(" [0-9] " " ("+" | "-") " " [0-9] ")"'}},
     lambda t: re.fullmatch(r"\([0-9] [+-] [0-9]\)", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_completions_with_vllm_fields_match(client: openai.OpenAI, extra: dict, check) -> None:  # noqa: ANN001
    resp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=0.9, seed=2, n=3,
                                     extra_body=extra)
    for c in resp.choices:
        assert c.finish_reason == "stop" and check(c.text), (extra, c.text)


def test_a_constraint_that_cannot_compile_is_a_400_while_others_finish(server: ServerProcess,
                                                                        client: openai.OpenAI) -> None:
    done: list[int] = []

    def innocent() -> None:
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
        done.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=innocent) for _ in range(3)]
    for t in threads:
        t.start()
    bad = [
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": {"json": {"type": "objectx"}}},
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "xml"}},
    ]
    for extra in bad:
        r = httpx.post(f"{server.url}/v1/completions",
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["message"] and set(err) == {"message", "type", "param", "code"}
    for t in threads:
        t.join(timeout=300)
    assert done == [40, 40, 40]


def test_logit_bias_through_the_client(server: ServerProcess, client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                     logit_bias={"1234": 100}, extra_body={"ignore_eos": True})
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": resp.choices[0].text, "add_special_tokens": False})
    assert tok.json()["tokens"] == [1234] * 3
    for bad in ({"1234": 500}, {"x": 1}, {"99999999": 1}):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


@pytest.mark.long
def test_bench_serve_json_schema_against_the_server(server: ServerProcess, tmp_path) -> None:  # noqa: ANN001
    """`pagoda bench serve --dataset json-schema`: every output validates, the unconstrained twin run
    generates exactly as many tokens, and new and cached schemas' TTFT are reported."""
    from pagoda.entrypoints.cli import main as cli_main

    out = tmp_path / "r.json"
    assert cli_main(["bench", "serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
                     "--dataset", "json-schema", "--num-prompts", "4", "--output-len-range", "16", "128",
                     "--max-concurrency", "4", "--compare-unconstrained", "--schema-ttft-rounds", "1",
                     "--save-result", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["metrics"]["completed"] == 4
    assert rep["structured"]["valid"] + rep["structured"]["cut"] == 4 and rep["structured"]["invalid"] == 0
    free = rep["unconstrained"]["metrics"]
    assert free["completed"] == 4 and free["total_output_tokens"] == rep["metrics"]["total_output_tokens"]
    assert rep["unconstrained"]["same_tokens_again"] and rep["unconstrained"]["ratio"] > 0
    assert rep["schema_ttft_ms"]["new_ms"] > 0 and rep["schema_ttft_ms"]["cached_ms"] > 0
