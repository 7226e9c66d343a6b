"""The ASGI app of a multi-model server: each request goes to its model's app (create_app over that model's
engine), chosen by the `model` field of its JSON body; a request that names no model, and every route that
is not about one (files, batches, stored responses), goes to the first model given.

The dispatcher answers itself what is about all the models: `/v1/models` (and llama-server's `/models`)
lists them with their state, `POST /models/load` and `POST /models/unload` (llama-server's names; body
`{"model": NAME}`, and for unload `"wait": false` to get a 409 rather than wait for requests in flight),
`/health` and `/metrics` (every loaded model's series, told apart by their `model_name` label).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from pagoda.entrypoints.server.errors import APIError, error_response
from pagoda.entrypoints.server.metrics import CONTENT_TYPE, render_models
from pagoda.entrypoints.server.models import ModelRegistry

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_LIST_PATHS = frozenset({"/v1/models", "/models"})
_MODEL_PATH = "/v1/models/"  # GET /v1/models/{name}: OpenAI's retrieve
_LOAD_PATH, _UNLOAD_PATH = "/models/load", "/models/unload"


class ModelDispatcher:
    """The ASGI app (the server wraps it in the key check and the body limit, as create_app's routes)."""

    def __init__(self, registry: ModelRegistry, idle_check_s: float = 5.0) -> None:
        self.registry = registry
        self.idle_check_s = idle_check_s
        self._idle_task: asyncio.Task[None] | None = None
        self._stopping = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path in _LIST_PATHS and method == "GET":
                answer: Response = JSONResponse({"object": "list", "data": self.registry.cards()})
            elif path.startswith(_MODEL_PATH) and method == "GET":
                answer = self.card(path[len(_MODEL_PATH):])
            elif path in (_LOAD_PATH, _UNLOAD_PATH) and method == "POST":
                answer = await self.load_or_unload(path, await read_json(receive))
            elif path == "/health" and method == "GET":
                answer = error_response(503, "the server is shutting down") if self._stopping else Response()
            elif path == "/metrics" and method == "GET":
                answer = Response(render_models(self.registry.metrics()), media_type=CONTENT_TYPE)
            else:
                await self.forward(scope, receive, send)
                return
        except APIError as e:
            answer = error_response(e.status, e.message, e.param, e.headers, path)
        await answer(scope, receive, send)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """To the app of the model the body names (the body is read here, then replayed to that app)."""
        headers = dict(scope.get("headers") or [])
        name: str | None = None
        if headers.get(b"content-type", b"application/json").startswith(b"application/json") and \
                scope["method"] in ("POST", "PUT", "PATCH"):
            body = await read_body(receive)
            receive = replay(body, receive)
            with contextlib.suppress(ValueError, UnicodeDecodeError):  # the model's app answers a bad body
                parsed = json.loads(body) if body else None
                if isinstance(parsed, dict) and isinstance(parsed.get("model"), str):
                    name = parsed["model"]
        try:
            slot = self.registry.slot(name)
            async with self.registry.serving(slot) as loaded:
                await loaded.app(scope, receive, send)
        except APIError as e:  # raised before the model's app started answering
            await error_response(e.status, e.message, e.param, e.headers, scope["path"])(scope, receive, send)

    def card(self, name: str) -> Response:
        slot = self.registry.slot(name)  # a 404 for a name no model has
        return JSONResponse(next(c for c in self.registry.cards() if c["id"] == slot.spec.name))

    async def load_or_unload(self, path: str, body: Any) -> Response:
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise APIError(400, 'the body must be {"model": NAME}', "model")
        slot = self.registry.slot(body["model"])
        if path == _LOAD_PATH:
            await self.registry.load(slot, retry=True)
            if slot.error is not None:
                raise APIError(500, slot.error, "model")
        else:
            wait = body.get("wait", True)
            if not isinstance(wait, bool):
                raise APIError(400, "wait must be true or false", "wait")
            await self.registry.unload(slot, wait)
        return JSONResponse({"success": True, "model": slot.spec.name, "status": slot.state.value})

    # ---- the server's start and end ------------------------------------------------------------
    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.registry.settings.preload:
                    await self.registry.preload()
                if self.registry.settings.idle_unload_s is not None:
                    self._idle_task = asyncio.create_task(self.unload_idle())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._stopping = True
                if self._idle_task is not None:
                    self._idle_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._idle_task
                await self.registry.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def begin_shutdown(self, timeout: float) -> None:
        self._stopping = True
        self.registry.begin_shutdown(timeout)

    async def unload_idle(self) -> None:
        limit = self.registry.settings.idle_unload_s or self.idle_check_s
        while True:
            await asyncio.sleep(min(self.idle_check_s, max(0.1, limit / 4)))
            try:
                await self.registry.unload_idle()
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("idle unload failed")


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def read_json(receive: Receive) -> Any:
    body = await read_body(receive)
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from e


def replay(body: bytes, receive: Receive) -> Receive:
    """The body once more, then the client's own messages (so its disconnect still reaches the app)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return again
