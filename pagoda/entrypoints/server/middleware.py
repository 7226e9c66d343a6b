"""Auth and the body limit: pure ASGI middlewares, so they run before body parsing and never wrap streaming
response bodies."""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from pagoda.entrypoints.server.errors import error_response
from pagoda.entrypoints.server.openapi import PUBLIC_PATHS


class APIKeyMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]], api_key: str) -> None:
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        # PUBLIC_PATHS (probes, metrics, the API docs) stay open; every other route needs the key.
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and scope.get("method") != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key.
            if not (secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
                    or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                await error_response(401, "invalid or missing API key (send Authorization: Bearer KEY, or "
                                          "x-api-key: KEY)", path=scope.get("path", ""))(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 to a body over `max_bytes` before any of it is parsed, declared or streamed.

    The body is read here (the app reads it whole anyway) and replayed; after it, receive() goes to the
    client again, so disconnects still reach the handlers. `uploads` names paths whose POSTs have their own,
    larger, limit (file uploads: `--max-upload-bytes`); the read deadline grows with it.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int, read_timeout_s: float = 30.0,
                 uploads: tuple[tuple[str, ...], int] = ((), 0)) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s
        self.upload_paths, self.max_upload_bytes = uploads

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope.get("method") == "POST" and scope.get("path") in self.upload_paths
        max_bytes, flag = (self.max_upload_bytes, "--max-upload-bytes") if upload else \
            (self.max_bytes, "--max-request-body-bytes")
        too_large = error_response(413, f"request body is larger than the server's limit of {max_bytes} "
                                        f"bytes ({flag})", path=scope.get("path", ""))
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:  # uvicorn itself refuses malformed ones
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        # One deadline for the whole body, not one per read: a byte every few seconds must not hold a slot forever.
        # An upload gets a second more per MiB over the usual limit.
        read_timeout_s = self.read_timeout_s + (max(0, max_bytes - self.max_bytes) >> 20)
        deadline = asyncio.get_running_loop().time() + read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0))
            except TimeoutError:  # a client that declares more than it sends must not hold its slot forever
                await error_response(408, f"request body not received within {read_timeout_s:.0f} s",
                                     path=scope.get("path", ""))(
                    scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client is gone before it finished sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending: list[dict[str, Any]] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
