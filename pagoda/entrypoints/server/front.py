"""The public front of `pagoda serve --data-parallel-size N`: the one listener on --host/--port.

vllm-router cannot keep clients off its admin routes or check a user's key on its own (keyed_router.py), so
clients never reach it. This small ASGI app is what they reach:

- the user's API key is checked as a single server checks it (APIKeyMiddleware: every route but the public
  probes of openapi.PUBLIC_PATHS), and is never sent on: requests go to the router on loopback with the worker
  secret in its place, so the router, a worker added behind our back, or a replica's log never see it;
- vllm-router's admin routes (add, remove and list workers, their loads) get a 403: only the launcher, with
  the secret, changes which replicas serve;
- `POST /flush_cache` and `POST /reset_prefix_cache` go to every replica (the router's own fan-out carries
  no key, so every keyed replica refused it);
- `/health` is 200 while the router has a replica to send requests to (its /readiness), else 503;
- responses stream through as they arrive, never buffered; an event stream cut before its `data: [DONE]`
  (the replica serving it died) ends with an error event and `data: [DONE]`, as a single server ends a
  failed stream, instead of a bare close; a client that leaves closes its request upstream at once, so the
  replica stops generating for it.

Run as `python -m pagoda.entrypoints.server.front --host H --port P --router URL --replica URL...`, with the
worker secret in PAGODA_WORKER_SECRET and the user's key, if any, in PAGODA_API_KEY.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response

from pagoda.entrypoints.server import connections
from pagoda.entrypoints.server.errors import error_body, error_response
from pagoda.entrypoints.server.keyed_router import WORKER_SECRET_ENV
from pagoda.entrypoints.server.middleware import APIKeyMiddleware

# vllm-router's admin and worker-management routes (src/server.rs): they decide where requests and their
# prompts go, so only the launcher may call them, on the router's loopback port.
ROUTER_ADMIN_PATHS = frozenset({"/add_worker", "/remove_worker", "/list_workers", "/get_loads", "/workers"})
# Routes that mean "every replica": a prefix cache left on one of them would make the next run warm.
FAN_OUT_PATHS = frozenset({"/flush_cache", "/reset_prefix_cache"})
# Headers about one connection, not the request (RFC 9110 7.6.1); host and authorization are set anew.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade", b"host", b"authorization"})
_DONE = b"data: [DONE]\n\n"
_ERROR_TEXT_BYTES = 4096  # of a plain-text error body from the router, turned into OpenAI's shape
_STREAM_CUT = ("the stream was cut: the replica serving this request stopped before it finished (the launcher "
               "restarts it); retry the request")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class FrontConfig:
    router_url: str  # the keyed router on loopback
    replica_urls: tuple[str, ...]
    worker_secret: str


def route_of(path: str) -> str:
    """The route a path reaches once its empty and dot segments are resolved ('//x/../add_worker/' is
    '/add_worker'; the HTTP client that forwards a request resolves dot segments too), so that no spelling of
    an admin route slips through."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part and part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


def is_router_admin(route: str) -> bool:
    return route in ROUTER_ADMIN_PATHS or route.startswith("/workers/")


def sse_error(status: int, message: str) -> bytes:
    """A failed stream's last events, in the shape a single server sends them (serving.py)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n" + _DONE


async def whole_events(raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The upstream's events, passed on each whole as soon as it is; a stream that stops before
    `data: [DONE]`, cut or closed early, ends with an error event instead (the broken event is dropped)."""
    pending, finished = b"", False
    try:
        async for chunk in raw:
            pending += chunk
            end = pending.rfind(b"\n\n") + 2
            if end >= 2:
                whole, pending = pending[:end], pending[end:]
                finished = whole.endswith(_DONE)
                yield whole
    except httpx.HTTPError:
        finished = False
    if not finished:
        yield sse_error(503, _STREAM_CUT)


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Front:
    """The ASGI app, without the key check (build_app adds it)."""

    def __init__(self, config: FrontConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        # No read timeout: a stream waits as long as its request generates (the router bounds it).
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                                  limits=httpx.Limits(max_connections=None))
        self.auth = (b"authorization", f"Bearer {config.worker_secret}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        route = route_of(scope["path"])
        raw_path = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            raw_path += b"?" + scope["query_string"]
        target = httpx.URL(self.config.router_url).copy_with(raw_path=raw_path)
        # Checked as the client spelled it and as it will be sent: they differ where the client resolves dots.
        if is_router_admin(route) or is_router_admin(route_of(target.path)):
            answer: Callable[[Scope, Receive, Send], Awaitable[None]] = error_response(
                403, f"{route} is the router's admin route: it is not served on this port (the launcher alone "
                     "adds and removes replicas)")
        elif route == "/health":
            answer = await self.health()
        elif route in FAN_OUT_PATHS and scope["method"] == "POST":
            answer = await self.fan_out(route)
        else:
            await self.forward(target, scope, receive, send)
            return
        await answer(scope, receive, send)

    async def health(self) -> Response:
        try:
            ready = await self.client.get(f"{self.config.router_url}/readiness", headers=[self.auth], timeout=5.0)
        except httpx.HTTPError:
            return error_response(503, "the router does not answer")
        if ready.status_code != 200:
            return error_response(503, "no replica is ready")
        return Response(status_code=200)

    async def fan_out(self, route: str) -> Response:
        async def one(rank: int, url: str) -> str | None:
            try:
                r = await self.client.post(url + route, headers=[self.auth], timeout=30.0)
            except httpx.ConnectError:
                return None  # a replica that is down holds no cache, and one that restarts starts empty
            except httpx.HTTPError as e:
                return f"replica {rank}: {type(e).__name__}"
            return None if r.status_code < 300 else f"replica {rank}: HTTP {r.status_code}"

        failed = [f for f in await asyncio.gather(*(one(i, u) for i, u in enumerate(self.config.replica_urls))) if f]
        if failed:
            return error_response(503, f"{route} failed on {', '.join(failed)}")
        return Response(status_code=200)

    async def forward(self, target: httpx.URL, scope: Scope, receive: Receive, send: Send) -> None:
        """The request to the router with the secret for the client's key; the answer back as it streams. A
        client that leaves, before the answer or during it, closes the request to the router at once."""
        sent = scope["headers"]
        headers = [(k, v) for k, v in sent if k.lower() not in _HOP_BY_HOP] + [self.auth]
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in sent)
        body_read = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    yield message.get("body", b"")
                    if not message.get("more_body", False):
                        return
            finally:
                body_read.set()

        async def client_gone() -> None:
            await body_read.wait()  # until then the body's reader owns receive()
            await _until_disconnected(receive)

        if not has_body:
            body_read.set()
        request = self.client.build_request(scope["method"], target, headers=headers,
                                            content=body() if has_body else None)
        exchange = asyncio.ensure_future(self.exchange(request, scope, receive, send))
        gone = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait((exchange, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exchange, gone):
                task.cancel()
            await asyncio.gather(exchange, gone, return_exceptions=True)
        error = None if exchange.cancelled() else exchange.exception()
        if error is not None:
            raise error

    async def exchange(self, request: httpx.Request, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError:
            await error_response(503, "the router did not answer")(scope, receive, send)
            return
        try:
            await self.relay(upstream, scope, receive, send)
        finally:
            await upstream.aclose()  # what tells the router, and through it the replica, that the client left

    async def relay(self, upstream: httpx.Response, scope: Scope, receive: Receive, send: Send) -> None:
        ctype = upstream.headers.get("content-type", "")
        if upstream.status_code >= 400 and not ctype.startswith(("application/json", "text/event-stream")):
            # The router's own refusals are plain text ("No workers are currently available"): OpenAI's shape.
            text = b""
            async for chunk in upstream.aiter_raw():
                text += chunk
                if len(text) >= _ERROR_TEXT_BYTES:
                    break
            message = text[:_ERROR_TEXT_BYTES].decode("utf-8", "replace").strip() or f"HTTP {upstream.status_code}"
            await error_response(upstream.status_code, message)(scope, receive, send)
            return
        plain = upstream.headers.get("content-encoding") in (None, "identity")
        events = ctype.startswith("text/event-stream") and plain
        headers = [(k.lower(), v) for k, v in upstream.headers.raw
                   if k.lower() not in _HOP_BY_HOP and not (events and k.lower() == b"content-length")]
        chunks = whole_events(upstream.aiter_raw()) if events else upstream.aiter_raw()
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError:
            return  # a plain body cut halfway cannot be mended: the connection closes without its end
        finally:
            with contextlib.suppress(Exception):
                await chunks.aclose()  # type: ignore[attr-defined]  # both are async generators
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(config: FrontConfig, api_key: str | None,
              client: httpx.AsyncClient | None = None) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    front = Front(config, client)
    return APIKeyMiddleware(front, api_key) if api_key else front


def main(argv: list[str]) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m pagoda.entrypoints.server.front", description=__doc__.split("\n")[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--router", required=True, help="the keyed router's URL")
    p.add_argument("--replica", nargs="+", required=True, help="each replica's URL")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--max-connections", type=int, default=None)
    p.add_argument("--header-timeout", type=float, default=10.0)
    args = p.parse_args(argv)
    secret = os.environ.get(WORKER_SECRET_ENV)
    if not secret:
        print(f"front: {WORKER_SECRET_ENV} is not set", file=sys.stderr)
        return 2
    config = FrontConfig(args.router.rstrip("/"), tuple(u.rstrip("/") for u in args.replica), secret)
    app = build_app(config, os.environ.get("PAGODA_API_KEY") or None)
    # The router's own Date and Server headers pass through; the launcher stops the replicas before this.
    connections.rate_limit_logs()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, lifespan="off",
                server_header=False, date_header=False, timeout_graceful_shutdown=3,
                http=connections.guarded_protocol(args.max_connections or connections.default_max_connections(),
                                                  args.header_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
