"""Errors in OpenAI's shape: every failure a client sees is {"error": {message, type, param, code}}; on
Anthropic's Messages routes (MESSAGES_PATH) in Anthropic's: {"type": "error", "error": {type, message}}."""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.entrypoints.server import protocol as P
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    info = P.ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "APIError"), param=param, code=status)
    return P.ErrorResponse(error=info).model_dump()


MESSAGES_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    info = P.AnthropicErrorInfo(type=_ANTHROPIC_TYPES.get(status, "api_error"), message=message)
    return P.AnthropicErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error in the shape of the route at `path` (OpenAI's unless it is one of Anthropic's)."""
    body = anthropic_error_body if path.startswith(MESSAGES_PATH) else error_body
    return JSONResponse(body(status, message, param), status_code=status, headers=headers)


def _param_of(message: str, known: set[str]) -> str | None:
    """SamplingParams and the engine name the offending parameter first ('temperature must be ...')."""
    first = re.split(r"[\s\[.:,]", message, maxsplit=1)[0]  # 'tools[0].function.name: ...' names tools
    if first in known:
        return first
    for name in ("max_tokens", "prompt", "messages", "logprobs", "max_model_len"):
        if name in message:
            return "max_tokens" if name == "max_model_len" else name
    return None


_KNOWN_PARAMS = set(P.CompletionRequest.model_fields) | set(P.ChatCompletionRequest.model_fields) | \
    set(SamplingParams.__dataclass_fields__)


def bad_request(e: Exception) -> APIError:
    msg = str(e)
    return APIError(400, msg, _param_of(msg, _KNOWN_PARAMS))


def install_error_handlers(app: FastAPI) -> None:
    """Every error `app` answers in the shape of its route (OpenAI's, Anthropic's on the Messages routes)."""

    def error(request: Request, status: int, message: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        return error_response(status, message, param, headers, request.url.path)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error(request, e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for err in e.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
        return error(request, 400, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error(request, e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        # A bug in a handler: OpenAI's shape, never text/plain, and no internals in the message.
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return error(request, 500, "internal server error")
