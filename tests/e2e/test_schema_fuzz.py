"""Schema fuzzing: schemathesis drives every operation of the server's own /openapi.json against a real
`pagoda serve` (pytest -m fuzz). No 5xx, every error in OpenAI's shape, and status codes, content types
and bodies as the document declares them. Generation is capped at a few tokens so the run stays bounded."""
from __future__ import annotations

import functools
import json
import time
import zlib
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pagoda.entrypoints.server.app import ServerSettings, create_app
from pagoda.entrypoints.server.errors import MESSAGES_PATH
from pagoda.entrypoints.server.openapi import GENERATION_ROUTES, NAMED_EVENT_ROUTES, PUBLIC_PATHS
from tests.e2e.conftest import MODEL_NAME

if TYPE_CHECKING:
    from tests.e2e.conftest import ServerProcess

# Generated cases per operation in the fuzzing phase (the examples and coverage phases add their own).
MAX_EXAMPLES = 400
MAX_TOKENS = 8  # generated tokens per choice; an uncapped max_tokens would make an example run for seconds
MAX_CHOICES = 2  # n, best_of
REQUEST_TIMEOUT_S = 60


def openai_error_shape(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """Every non-2xx body is `{"error": {"message", "type", "param", "code"}}`, or on Anthropic's Messages routes
    `{"type": "error", "error": {"type", "message"}}`."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.content[:200]!r}") from None
    if case.path.startswith(MESSAGES_PATH):
        assert isinstance(body, dict) and body.get("type") == "error" and set(body) == {"type", "error"}, \
            f"not Anthropic's error shape: {body!r}"
        err = body["error"]
        assert isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str) \
            and err["message"], f"error: {err!r}"
        return
    assert isinstance(body, dict) and set(body) == {"error"}, f"not OpenAI's error shape: {body!r}"
    err = body["error"]
    assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), f"error lacks keys: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"error.message: {err!r}"
    assert isinstance(err["type"], str) and err["type"], f"error.type: {err!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"error.param: {err!r}"
    assert err["code"] is None or isinstance(err["code"], (int, str)), f"error.code: {err!r}"


def no_server_error_events(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """A stream that failed after its 200 reports the error as an event: a 5xx there is a server error too."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return
    for line in response.content.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {") and '"error"' in line:
            event = json.loads(line[len("data: "):])
            code = event.get("error", {}).get("code") if isinstance(event.get("error"), dict) else None
            assert not (isinstance(code, int) and code >= 500), f"server error event in the stream: {line[:300]}"


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_error_shape, no_server_error_events]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def bound_generation(case: schemathesis.Case) -> None:
    """Cap what a generation request may cost: at most MAX_TOKENS tokens and MAX_CHOICES choices. A field of
    the wrong type is left alone (that case tests the 400). Half the cases that leave `stream` out (most do)
    stream, chosen by the body's hash so that a failing case replays (`@schema.given` would turn off
    schemathesis's coverage phase)."""
    body, path = case.body, case.operation.path
    if path not in GENERATION_ROUTES and path not in NAMED_EVENT_ROUTES or not isinstance(body, dict):
        return
    if "stream" not in body and zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 2:
        body["stream"] = True
    for key, cap in (("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS),
                     ("max_output_tokens", MAX_TOKENS), ("n", MAX_CHOICES), ("best_of", MAX_CHOICES)):
        if _is_int(body.get(key)) and body[key] > cap:
            body[key] = cap
    if path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = MAX_TOKENS  # null or absent: up to the context length
    if path in GENERATION_ROUTES and body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess, fuzz_api_key: str) -> schemathesis.BaseSchema:
    # Auth through the document's own security scheme, so the cases that probe auth go out as generated.
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"bearerAuth": {"bearer": fuzz_api_key}}}})
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.fuzz
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_every_operation_answers_as_its_document_says(case: schemathesis.Case) -> None:
    bound_generation(case)
    case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT_S)


# Valid requests the fuzzer rarely builds (most random sampling values are out of range): streaming, several
# choices, echo with logprobs, usage chunks.
GENERATION_BODIES = {
    "/v1/completions": [
        {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0},
        {"prompt": ["Hi", "The sky is"], "n": 2, "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}},
        {"prompt": [1, 2, 3], "max_tokens": 4, "echo": True, "logprobs": 2, "stream": True},
        {"prompt": "Stop here.", "max_tokens": 8, "stop": ["."], "logprobs": 1, "echo": True},
    ],
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True, "n": 2,
         "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_completion_tokens": 4,
         "logprobs": True, "top_logprobs": 3},
    ],
}


@pytest.mark.fuzz
@pytest.mark.parametrize(("path", "body"), [pytest.param(p, b, id=f"{p}-{i}")
                                            for p, bodies in GENERATION_BODIES.items() for i, b in enumerate(bodies)])
def test_generation_answers_match_the_document(api_schema: schemathesis.BaseSchema, fuzz_api_key: str, path: str,
                                               body: dict[str, Any]) -> None:
    case = api_schema[path]["POST"].Case(body=body)
    response = case.call_and_validate(headers={"Authorization": f"Bearer {fuzz_api_key}"}, checks=CHECKS,
                                      timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    expected = "text/event-stream" if body.get("stream") else "application/json"
    assert response.headers["content-type"][0].startswith(expected)
    if body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]


def _operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, item in doc["paths"].items() for method, op in item.items()]


def _check_documented(status: int, doc: dict[str, Any], send: Any) -> None:
    """Each operation answers `status` (in OpenAI's shape) to `send(method, path, op)` iff it documents it."""
    wrong = []
    for method, path, op in _operations(doc):
        r = send(method, path, op)
        documented = str(status) in op["responses"]
        if documented != (r.status_code == status):
            wrong.append(f"{method.upper()} {path}: {r.status_code} ({status} documented: {documented})")
        elif documented:
            where = SimpleNamespace(path=path)
            openai_error_shape(None, schemathesis.Response.from_any(r), where)  # type: ignore[arg-type]
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def served_document(fuzz_server: ServerProcess) -> dict[str, Any]:
    return httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()


@pytest.mark.fuzz
def test_documented_401s_are_what_the_server_answers_without_a_key(fuzz_server: ServerProcess,
                                                                   served_document: dict[str, Any]) -> None:
    _check_documented(401, served_document, lambda method, path, op: httpx.request(
        method, fuzz_server.url + path, json={} if "requestBody" in op else None, timeout=30))


@pytest.mark.fuzz
def test_documented_413s_are_what_the_server_answers_over_the_body_limit(
        fuzz_server: ServerProcess, served_document: dict[str, Any], fuzz_api_key: str, fuzz_body_limit: int) -> None:
    body = json.dumps({"prompt": "x" * fuzz_body_limit})
    headers = {"Authorization": f"Bearer {fuzz_api_key}", "Content-Type": "application/json"}
    _check_documented(413, served_document, lambda method, path, op: httpx.request(
        method, fuzz_server.url + path, content=body, headers=headers, timeout=30))


# ---- the document itself, without a server (runs in the default suite) -------------------------------
@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    engine = SimpleNamespace(engine=SimpleNamespace(tokenizer=None),
                             input_processor=SimpleNamespace(tokenizer=None))
    return create_app(engine, ServerSettings(served_model_names=["m"])).openapi()  # type: ignore[arg-type]


def test_openapi_declares_400_with_openai_errors_never_fastapis_422(document: dict[str, Any]) -> None:
    text = json.dumps(document)
    assert '"422"' not in text and "HTTPValidationError" not in text and '"ValidationError"' not in text
    assert "ErrorResponse" in document["components"]["schemas"]
    for path, item in document["paths"].items():
        for method, op in item.items():
            if "requestBody" in op:
                error = op["responses"]["400"]["content"]["application/json"]["schema"]
                shape = "AnthropicErrorResponse" if path.startswith(MESSAGES_PATH) else "ErrorResponse"
                assert error == {"$ref": f"#/components/schemas/{shape}"}, f"{method} {path}"


def test_openapi_declares_sse_on_generation_routes_and_auth_off_public_ones(document: dict[str, Any]) -> None:
    for path in GENERATION_ROUTES:
        op = document["paths"][path]["post"]
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"400", "401", "404", "413", "500", "503"} <= set(op["responses"])
    for path, item in document["paths"].items():
        for op in item.values():
            assert ("401" in op["responses"]) == (path not in PUBLIC_PATHS), path
    assert not document["paths"]["/health"]["get"]["responses"]["200"].get("content")


def test_openapi_document_loads_in_schemathesis(document: dict[str, Any]) -> None:
    labels = [op.ok().label for op in schemathesis.openapi.from_dict(document).get_all_operations()]
    assert "POST /v1/chat/completions" in labels and "GET /metrics" in labels


# ---- hostile constraints: generated schemas that once killed or froze the server ------------------------
def _hostile_schemas() -> st.SearchStrategy[dict[str, Any]]:
    names = st.text("abcdefgh", min_size=1, max_size=4)
    recursive = names.map(lambda n: {"$defs": {n: {"type": "object", "properties": {"c": {"$ref": f"#/$defs/{n}"}},
                                                   "required": ["c"]}}, "$ref": f"#/$defs/{n}"})
    long_array = st.integers(10**3, 10**12).map(lambda k: {"type": "array", "items": {"const": "x"}, "minItems": k})
    big_enum = st.integers(4000, 30000).map(lambda k: {"enum": [f"value {i}" for i in range(k)]})
    deep = st.integers(100, 400).map(lambda d: functools.reduce(
        lambda inner, _: {"type": "object", "properties": {"a": inner}, "required": ["a"]}, range(d),
        {"type": "string"}))
    return st.one_of(recursive, long_array, big_enum, deep)


@pytest.mark.fuzz
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_hostile_schemas())
def test_hostile_schemas_are_answered_without_hurting_the_server(fuzz_server: ServerProcess, fuzz_api_key: str,
                                                               schema: dict[str, Any]) -> None:
    """Recursive $ref, minItems in the billions, huge enums and deep nesting: each a 400 (or a bounded answer)
    within the compile budget, and /health answers within a second right after."""
    headers = {"Authorization": f"Bearer {fuzz_api_key}"}
    body = {"model": MODEL_NAME, "prompt": "JSON:", "max_tokens": 8,
            "structured_outputs": {"json": schema}}
    r = httpx.post(f"{fuzz_server.url}/v1/completions", json=body, headers=headers, timeout=90)
    assert r.status_code in (200, 400, 413), r.text[:300]
    if r.status_code != 200:
        openai_error_shape(None, schemathesis.Response.from_any(r), SimpleNamespace(path="/v1/completions"))
    t0 = time.monotonic()
    assert httpx.get(f"{fuzz_server.url}/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0
