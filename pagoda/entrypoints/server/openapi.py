"""The OpenAPI document as the server behaves, not as FastAPI guesses.

FastAPI declares a 422 with its own validation body on every route that takes input, and knows nothing of
what the handlers answer themselves. The server answers every error in OpenAI's shape (`ErrorResponse`; on
Anthropic's Messages routes `AnthropicErrorResponse`) with a 400 for invalid input, streams server-sent events
when `stream` is true, and returns bare bodies from its operational routes. `install_openapi` rewrites the
generated document once, on first request.
"""
from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import MESSAGES_PATH
from pagoda.entrypoints.server.metrics import CONTENT_TYPE

_REF = "#/components/schemas/{model}"
_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})
_FASTAPI_SCHEMAS = ("HTTPValidationError", "ValidationError")

# No API key needed here, even when the server runs with --api-key.
# /ping and the load routes are probes too: vllm-router polls /get_load without the client's key.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/load", "/get_load", "/version", "/metrics", "/openapi.json", "/docs",
                          "/docs/oauth2-redirect", "/redoc"})

# Routes that generate: their JSON body and one chunk of their event stream (`stream: true`).
GENERATION_ROUTES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (P.CompletionResponse, P.CompletionStreamResponse),
    "/v1/chat/completions": (P.ChatCompletionResponse, P.ChatCompletionStreamResponse),
}

# Routes that stream named events (`stream: true`): their JSON body's model (None: an object) and the events.
NAMED_EVENT_ROUTES: dict[str, tuple[str | None, str]] = {
    MESSAGES_PATH: ("MessagesResponse", "Anthropic's events: message_start, content_block_start, content_block_delta, "
                                        "content_block_stop, message_delta, message_stop; error after the 200"),
    "/v1/responses": (None, "response.created, response.in_progress, response.output_item.added, "
                            "response.content_part.added, response.output_text.delta, "
                            "response.function_call_arguments.delta, their .done events, response.completed or "
                            "response.incomplete; error after the 200"),
}

# The pooling routes (serving_pooling.py), whose handlers return dicts: their answers' schemas by name, and
# the status a failed forward adds (500).
POOLING_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"$ref": _REF.format(model="EmbeddingResponse")},
    "/score": {"$ref": _REF.format(model="ScoreResponse")},
    "/v1/score": {"$ref": _REF.format(model="ScoreResponse")},
    **{path: {"anyOf": [{"$ref": _REF.format(model="RerankResponse")},
                        {"type": "array", "items": {"$ref": _REF.format(model="TEIRerankResult")}}]}
       for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    "/embed": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
}

# Routes whose handler returns a bare Response, so FastAPI cannot see the 200: its content ({} = no body).
PLAIN_OK: dict[str, dict[str, Any]] = {
    "/health": {},
    "/ping": {},
    "/health_generate": {},
    "/reset_prefix_cache": {},
    "/flush_cache": {},
    "/metrics": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
}

# Error statuses a route answers besides those the rules in `_error_statuses` find.
EXTRA_ERRORS: dict[str, frozenset[int]] = {"/health": frozenset({503}), "/ping": frozenset({503}),
                                           "/health_generate": frozenset({503}),
                                           "/v1/responses": frozenset({404}),  # previous_response_id
                                           "/v1/responses/{response_id}": frozenset({404}),
                                           "/v1/unload_lora_adapter": frozenset({404}),
                                           "/v1/load_lora_adapter": frozenset({404})}
# Files and batch jobs: 404 for an id that is not there (or the routes off: no --batch-dir), 503 where the folder
# cannot be opened.
EXTRA_ERRORS |= {path: frozenset({404, 503}) for path in (
    "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}",
    "/v1/batches/{batch_id}/cancel")}

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field of the wrong type, or a value out of range",
    401: "Missing or wrong API key (only when the server runs with --api-key)",
    404: "The model is not served (or the stored response, file, batch or adapter is not there)",
    408: "The request body did not arrive in time",
    413: "Request body over the size limit (an upload: over --max-upload-bytes)",
    500: "The engine failed while generating this request",
    503: "Shutting down, engine stopped, or too many waiting requests; Retry-After says when to retry",
}

_SECURITY_SCHEME = {"type": "http", "scheme": "bearer",
                    "description": "Required only when the server runs with --api-key (or $PAGODA_API_KEY)"}


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (and /openapi.json, /docs) return the rewritten document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = truthful(copy.deepcopy(generate()))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def truthful(doc: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a FastAPI-generated document in place (and return it) to match the server's answers."""
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    from pagoda.entrypoints.server import serving_pooling as pooling
    from pagoda.entrypoints.server.serving_messages import MessagesResponse

    _add_models(schemas, [P.ErrorResponse, P.AnthropicErrorResponse, MessagesResponse,
                          *(m for pair in GENERATION_ROUTES.values() for m in pair)])
    if any(path in POOLING_ROUTES for path in doc.get("paths", {})):
        _add_models(schemas, [pooling.EmbeddingResponse, pooling.ScoreResponse, pooling.RerankResponse,
                              pooling.TEIRerankResult])
    protected = False
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if method not in _METHODS:
                continue
            responses = op.setdefault("responses", {})
            if path in PLAIN_OK:
                responses["200"] = _ok(PLAIN_OK[path])
            if path in GENERATION_ROUTES:
                full, chunk = GENERATION_ROUTES[path]
                responses["200"] = _ok({"application/json": {"schema": _ref(full.__name__)},
                                        "text/event-stream": {"schema": _sse_event(chunk.__name__)}})
            if path in POOLING_ROUTES:
                responses["200"] = _ok({"application/json": {"schema": POOLING_ROUTES[path]}})
            if path in NAMED_EVENT_ROUTES:  # `event: <type>` + `data: <JSON>` per event
                body, events = NAMED_EVENT_ROUTES[path]
                responses["200"] = _ok({"application/json": {"schema": _ref(body) if body else {"type": "object"}},
                                        "text/event-stream": {"schema": _named_event(events)}})
            invalid = responses.pop("422", None) is not None  # FastAPI's validation error: the server answers 400
            shape = "AnthropicErrorResponse" if path.startswith(MESSAGES_PATH) else "ErrorResponse"
            for status in sorted(_error_statuses(path, op, schemas, invalid)):
                responses[str(status)] = _error(status, shape)
            if path not in PUBLIC_PATHS:
                op["security"] = [{"bearerAuth": []}]
                protected = True
            op["responses"] = dict(sorted(responses.items()))
    if protected:
        components.setdefault("securitySchemes", {})["bearerAuth"] = _SECURITY_SCHEME
    for name in _FASTAPI_SCHEMAS:  # only the 422s used them
        schemas.pop(name, None)
    return doc


def _error_statuses(path: str, op: dict[str, Any], schemas: dict[str, Any], invalid: bool) -> set[int]:
    """The error statuses an operation answers; `invalid`: it validates input (FastAPI declared a 422)."""
    statuses = set(EXTRA_ERRORS.get(path, ()))
    if invalid:
        statuses.add(400)
    if path not in PUBLIC_PATHS:
        statuses.add(401)
    if "model" in _body_properties(op, schemas):
        statuses.add(404)
    statuses |= {408, 413}  # the body limit and read timeout hold for every request, read before routing
    if path in GENERATION_ROUTES or path in NAMED_EVENT_ROUTES:
        statuses |= {400, 500, 503}
    if path in POOLING_ROUTES:
        statuses |= {400, 500}
    return statuses


def _body_properties(op: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    ref = schema.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        schema = schemas.get(ref.rsplit("/", 1)[1], {})
    return schema.get("properties", {})


def _add_models(schemas: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """Add the models' JSON schemas (and the models they nest) as components, as a client reads them."""
    _, top = models_json_schema([(m, "serialization") for m in dict.fromkeys(models)], ref_template=_REF)
    for name, schema in top.get("$defs", {}).items():
        schemas.setdefault(name, schema)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _sse_event(chunk: str) -> dict[str, Any]:
    """One server-sent event: `data:` holds a chunk, an error (a failure after the 200), or `[DONE]`."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}},
            "description": f"`data: <{chunk} JSON>` per chunk, then `data: [DONE]`"}


def _named_event(names: str) -> dict[str, Any]:
    """One server-sent event with a name: `event:` its type, `data:` an object whose `type` says it again."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"type": "object", "required": ["type"]}}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": payload}, "description": names}


def _ok(content: dict[str, Any]) -> dict[str, Any]:
    return {"description": "Successful Response", **({"content": content} if content else {})}


def _error(status: int, shape: str = "ErrorResponse") -> dict[str, Any]:
    response: dict[str, Any] = {"description": ERROR_DESCRIPTIONS[status],
                                "content": {"application/json": {"schema": _ref(shape)}}}
    if status == 503:
        response["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                               "schema": {"type": "integer"}}}
    return response

