"""The FastAPI app: OpenAI's /v1 routes over one AsyncEngine (serving_completions.py, serving_chat.py), plus
health, tokenizer and metrics routes; errors in OpenAI's shape (errors.py) and the ASGI middlewares
(middleware.py)."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError, bad_request, error_response
from pagoda.entrypoints.server.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.entrypoints.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from pagoda.entrypoints.server.openapi import install_openapi
from pagoda.entrypoints.server.serving import Serving
from pagoda.entrypoints.server.serving_chat import ChatServing
from pagoda.entrypoints.server.serving_completions import create_completion
from pagoda.entrypoints.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "ServerSettings", "create_app"]

logger = logging.getLogger(__name__)


def create_app(engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    s = Serving(engine, settings)
    chat = ChatServing(s, settings.tool_call_parser)
    core, tokenizer, names = s.core, s.tokenizer, s.names

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # uvicorn has stopped accepting and waited for connections; finish or abort what is left.
        await engine.shutdown(settings.drain_timeout)

    app = FastAPI(title="pagoda", version=pagoda.__version__, lifespan=lifespan)
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:  # added last, so outermost: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.state.engine = engine
    app.state.metrics = metrics

    # ---- errors: always OpenAI's shape ------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for err in e.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return error_response(400, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        # A bug in a handler: OpenAI's shape, never text/plain, and no internals in the message.
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return error_response(500, "internal server error")

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions", response_model=None)
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        return await create_completion(s, req, request)

    @v1.post("/chat/completions", response_model=None)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Any:
        return await chat.create(req, request)

    @v1.get("/models")
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=name, root=settings.model_root or name,
                                             max_model_len=core.max_model_len) for name in names])

    app.include_router(v1)

    # ---- unauthenticated operational routes ----------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagoda.__version__, "cpu_kernels": core.runner.policy.kernel_set}

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> P.TokenizeResponse:
        s.check_model(req.model)
        if req.messages is not None:
            try:
                conv = P.ChatCompletionRequest(messages=req.messages).conversation()
            except ValueError as e:
                raise bad_request(e) from e
            ids = await s.chat_prompt(conv, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await s.off_loop(core.tokenize, req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return P.TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=list(ids))

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        s.check_model(req.model)
        vocab = core.args.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        return P.DetokenizeResponse(prompt=await s.off_loop(tokenizer.decode, req.tokens, param="tokens"))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    return app
