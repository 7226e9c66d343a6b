"""The FastAPI app: OpenAI's /v1 routes over one AsyncEngine, plus health, tokenizer and metrics routes."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.entrypoints.server.openapi import PUBLIC_PATHS, install_openapi
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tools import choose_format, plan_tools, prepare_conversation, template_reads_tools

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    drain_timeout: float = 30.0
    model_root: str | None = None
    retry_after_s: int = 1
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tool_call_parser: str | None = None  # None: the format the chat template writes


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    info = P.ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "APIError"), param=param, code=status)
    return P.ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


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


# ---- auth and body limit: pure ASGI middlewares, so they run before body parsing and never wrap
# streaming response bodies ------------------------------------------------------------------------
class APIKeyMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]], api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        # PUBLIC_PATHS (probes, metrics, the API docs) stay open; every other route needs the key.
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and scope.get("method") != "OPTIONS":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.expected):
                await error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)")(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 to a body over `max_bytes` before any of it is parsed, declared or streamed.

    The body is read here (the app reads it whole anyway) and replayed; after it, receive() goes to the
    client again, so disconnects still reach the handlers.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_response(413, f"request body is larger than the server's limit of {self.max_bytes} "
                                        "bytes (--max-request-body-bytes)")
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # uvicorn itself refuses malformed ones
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:  # a client that declares more than it sends must not hold its slot forever
                await error_response(408, f"request body not received within {self.read_timeout_s:.0f} s")(
                    scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client is gone before it finished sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending: list[dict[str, Any]] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict[str, Any]:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


# ---- formatting helpers ---------------------------------------------------------------------------
def _finite(x: float) -> float:
    # JSON has no -Infinity; a probability of 0 becomes a very negative logprob, as vLLM does.
    return x if math.isfinite(x) else -9999.0


def _token_text(pos: PositionLogprobs, token_id: int, tokenizer: Any) -> str:
    lp = pos.get(token_id)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], tokenizer: Any,
                        text_offset: int) -> P.CompletionLogprobs:
    """Legacy completions logprobs; a None position (the first prompt token when echoing) has no logprob."""
    out = P.CompletionLogprobs()
    for tid, pos in zip(token_ids, positions):
        if pos is None:
            tok = tokenizer.decode([tid])
            out.tokens.append(tok)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            tok = _token_text(pos, tid, tokenizer)
            chosen = pos.get(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
            ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank or 0))
            out.top_logprobs.append({_token_text(pos, t, tokenizer): _finite(lp.logprob) for t, lp in ranked})
        out.text_offset.append(text_offset)
        text_offset += len(tok)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], tokenizer: Any,
                  top_n: int) -> P.ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions):
        tok = _token_text(pos, tid, tokenizer)
        chosen = pos.get(tid)
        top = [P.TopLogprob(token=_token_text(pos, t, tokenizer), logprob=_finite(lp.logprob),
                            bytes=list(_token_text(pos, t, tokenizer).encode()))
               for t, lp in sorted(pos.items(), key=lambda kv: kv[1].rank or 0)
               if lp.rank is not None and lp.rank <= top_n][:top_n]
        content.append(P.ChatLogprob(token=tok, logprob=_finite(chosen.logprob) if chosen else -9999.0,
                                     bytes=list(tok.encode()), top_logprobs=top))
    return P.ChatLogprobs(content=content)


def _visible_text(c: CompletionOutput, params: SamplingParams) -> str:
    """Text safe to stream now. While running, hold back the last len(stop)-1 characters: a stop string
    completed by a later token truncates the text there, and what was sent cannot be taken back."""
    if c.finish_reason is not None or not params.stop_strings:
        return c.text
    hold = max(len(s) for s in params.stop_strings) - 1
    return c.text[: max(0, len(c.text) - hold)]


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the prompt index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # cancelling a pump closes its stream, which aborts the request


async def _until_disconnected(request: Request) -> None:
    """Return when the client goes away. If the channel itself fails, wait forever rather than abort."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    except Exception:
        await asyncio.Event().wait()


def create_app(engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    core = engine.engine
    tokenizer = core.tokenizer
    names = settings.served_model_names
    template = getattr(tokenizer, "chat_template", None)
    tool_format = choose_format(settings.tool_call_parser, template)
    native_tools = template_reads_tools(template)  # else formats.py describes the tools

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

    # ---- shared request plumbing -------------------------------------------------------------
    def check_model(model: str | None) -> str:
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(names)}", "model")
        return model

    def check_capacity(num_new: int) -> None:
        if not engine.is_running:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(settings.retry_after_s)})
        limit = settings.max_waiting_requests
        if limit is not None and num_new > limit:  # would never fit: retrying cannot help
            raise APIError(400, f"{num_new} prompts in one request exceed the server's queue "
                                f"(--max-waiting-requests {limit}); split the batch", "prompt")
        if limit is not None and engine.num_waiting + num_new > limit:
            raise APIError(503, f"too many waiting requests (limit {limit}); retry later",
                           headers={"Retry-After": str(settings.retry_after_s)})

    async def off_loop(fn: Callable[..., Any], *args: Any, param: str = "prompt") -> Any:
        """Tokenizing and templating take up to seconds on large input: a worker thread does them, so
        streams and /health never wait on one request's text. Their ValueErrors are 400s."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), param) from e
        except UnicodeError as e:
            raise APIError(400, f"{param}: not valid Unicode text ({e})", param) from e

    async def compile_constraint(params: SamplingParams) -> None:
        """A grammar compiles on a worker thread (cached by its text): a bad one is this request's 400,
        and the engine then finds it ready, so the step loop never waits on a compiler."""
        if params.structured_outputs is not None:
            await off_loop(core.compile_structured, params, param="response_format")

    def tokenize_all(prompts: list[str | list[int]]) -> list[list[int]]:
        return [core.tokenize(p) if isinstance(p, str) else p for p in prompts]

    async def submit(prompts: list[list[int]], params: SamplingParams,
                     base_id: str, cache_salt: str | None = None) -> list[tuple[str, asyncio.Queue]]:
        """Queue every prompt, or none: a bad one aborts those already queued and raises a 400."""
        queued: list[tuple[str, asyncio.Queue]] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                queued.append(await engine.add_request(prompt, params, rid, cache_salt=cache_salt))
        except BaseException as e:
            for rid, _ in queued:
                engine.abort(rid)
            if isinstance(e, ValueError):
                raise bad_request(e) from e
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), headers={"Retry-After": str(settings.retry_after_s)}) from e
            raise
        return queued

    async def collect(request: Request, queued: list[tuple[str, asyncio.Queue]]) -> list[RequestOutput]:
        """Final outputs of every request; a client that goes away, or a cancelled handler, aborts them all."""
        async def last(rid: str, q: asyncio.Queue) -> RequestOutput | None:
            final = None
            async for out in engine.stream(rid, q):
                final = out
            return final

        # Plain tasks, not gather(): a cancelled gather future holds a CancelledError nobody retrieves.
        tasks = [asyncio.create_task(last(rid, q)) for rid, q in queued]
        watch = asyncio.create_task(_until_disconnected(request))
        try:
            pending: set[asyncio.Task] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    raise APIError(499, "client disconnected")
                pending.discard(watch)
        finally:
            for t in (watch, *tasks):
                t.cancel()
            for rid, _ in queued:  # no-op for finished requests; frees the KV blocks of the rest at once
                engine.abort(rid)
        for t in tasks:
            error = t.exception()
            if isinstance(error, EngineDeadError):
                raise APIError(503, str(error), headers={"Retry-After": str(settings.retry_after_s)}) from error
            if isinstance(error, RequestFailedError) and error.status == 400:  # its own constraint
                raise APIError(400, str(error), "response_format") from error
            if error is not None:  # the engine failed this request alone: a 500 for it
                logger.error("request %s failed: %s", queued[0][0] if queued else "?", error)
                raise APIError(500, f"internal error while generating: {error}") from error
        results = [t.result() for t in tasks]
        if any(r is None or not r.finished for r in results):
            raise APIError(503, "the request was aborted (server shutting down)",
                           headers={"Retry-After": str(settings.retry_after_s)})
        return results  # type: ignore[return-value]

    def usage_of(outs: list[RequestOutput]) -> P.Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def stream_events(request: Request, queued: list[tuple[str, asyncio.Queue]],
                            make_chunks: Callable[[int, RequestOutput], list[dict[str, Any]]],
                            preamble: list[dict[str, Any]],
                            empty_chunk: Callable[[list[dict[str, Any]]], dict[str, Any]] | None,
                            ) -> AsyncIterator[str]:
        streams = [engine.stream(rid, q) for rid, q in queued]
        finals: dict[int, RequestOutput] = {}
        watch = asyncio.create_task(_until_disconnected(request))
        def on_disconnect(t: asyncio.Task) -> None:
            if not t.cancelled():
                for rid, _ in queued:
                    engine.abort(rid)

        watch.add_done_callback(on_disconnect)
        merged = _merge(streams)
        try:
            for chunk in preamble:
                yield _sse(chunk)
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
                for chunk in make_chunks(i, out):
                    yield _sse(chunk)
            if len(finals) < len(queued):
                raise EngineDeadError("the request was aborted (server shutting down)")
            if empty_chunk is not None:  # stream_options.include_usage: a last chunk with no choices
                body = empty_chunk([])
                body["usage"] = usage_of(list(finals.values())).model_dump()
                yield _sse(body)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except EngineDeadError as e:
            yield _sse(error_body(503, str(e)))
        except RequestFailedError as e:
            if e.status != 400:
                logger.error("streaming request %s failed: %s", queued[0][0] if queued else "?", e)
            yield _sse(error_body(e.status, str(e) if e.status == 400 else f"internal error while generating: {e}"))
        except Exception as e:
            logger.exception("streaming request %s failed", queued[0][0] if queued else "?")
            yield _sse(error_body(500, f"internal error while generating: {e}"))
        finally:
            watch.cancel()
            with contextlib.suppress(Exception):
                await merged.aclose()
            for rid, _ in queued:  # no-op for finished requests; frees blocks of the rest at once
                engine.abort(rid)
        yield _sse("[DONE]")

    def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    v1 = APIRouter(prefix="/v1")

    # ---- /v1/completions -----------------------------------------------------------------------
    @v1.post("/completions", response_model=None)
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        model = check_model(req.model)
        try:
            params = req.to_sampling_params()
            prompts = req.prompts()
        except ValueError as e:
            raise bad_request(e) from e
        check_capacity(len(prompts))
        await compile_constraint(params)
        prompt_ids = await off_loop(tokenize_all, prompts)
        base_id = P.random_id("cmpl")
        queued = await submit(prompt_ids, params, base_id, req.cache_salt)
        n = params.n
        prompt_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if req.echo else []

        def prompt_logprobs(out: RequestOutput) -> P.CompletionLogprobs:
            positions = list(out.prompt_logprobs or [None])
            positions += [None] * (len(out.prompt_token_ids) - len(positions))
            return completion_logprobs(out.prompt_token_ids, positions, tokenizer, 0)

        if not req.stream:
            outs = await collect(request, queued)
            choices = []
            for i, out in enumerate(outs):
                for c in out.outputs:
                    text, lps = c.text, None
                    if req.logprobs is not None:
                        lps = completion_logprobs(c.token_ids, list(c.logprobs or []), tokenizer,
                                                  len(prompt_texts[i]) if req.echo else 0)
                    if req.echo:
                        text = prompt_texts[i] + text
                        if lps is not None:
                            pl = prompt_logprobs(out)
                            for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                                setattr(lps, key, getattr(pl, key) + getattr(lps, key))
                    choices.append(P.CompletionChoice(index=i * n + c.index, text=text, logprobs=lps,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            return P.CompletionResponse(id=base_id, model=model, choices=choices, usage=usage_of(outs))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        echoed: set[int] = set()

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            body = P.CompletionResponse(id=base_id, model=model, choices=[]).model_dump(exclude={"usage"})
            body["choices"] = choices
            if include_usage:
                body["usage"] = None
            return body

        def make_chunks(i: int, out: RequestOutput) -> list[dict[str, Any]]:
            result = []
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                prefix, lps = "", None
                if req.echo and idx not in echoed:
                    echoed.add(idx)
                    prefix = prompt_texts[i]
                    if req.logprobs is not None:
                        lps = prompt_logprobs(out)
                text = _visible_text(c, params)
                delta = text[sent_text.get(idx, 0):]
                ntok = len(c.token_ids) if c.finish_reason is not None or delta else sent_tokens.get(idx, 0)
                if not delta and not prefix and c.finish_reason is None:
                    continue  # e.g. half a UTF-8 character, or text held back for stop strings
                if req.logprobs is not None:
                    start = sent_tokens.get(idx, 0)
                    new = completion_logprobs(c.token_ids[start:ntok], list(c.logprobs or [])[start:ntok],
                                              tokenizer, len(prompt_texts[i]) * req.echo + sent_text.get(idx, 0))
                    if lps is not None:
                        for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                            setattr(lps, key, getattr(lps, key) + getattr(new, key))
                    else:
                        lps = new
                sent_text[idx] = len(text)
                sent_tokens[idx] = ntok
                if c.finish_reason is not None:
                    done.add(idx)
                result.append(chunk([P.CompletionChoice(index=idx, text=prefix + delta, logprobs=lps,
                                                        finish_reason=c.finish_reason,
                                                        stop_reason=c.stop_reason).model_dump()]))
            return result

        return sse_response(stream_events(request, queued, make_chunks, [], chunk if include_usage else None))

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        def render() -> list[int]:
            try:
                return core.tokenize_chat(messages, add_generation_prompt, tools)
            except (ValueError, UnicodeError):
                raise
            except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
                raise ValueError(f"messages: the chat template rejected them: {e}") from e

        return await off_loop(render, param="messages")

    @v1.post("/chat/completions", response_model=None)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Any:
        model = check_model(req.model)
        try:
            params = req.to_sampling_params()
            tools = req.tool_request()
            plan = plan_tools(tools, tool_format, params.structured_outputs)
            conversation, template_tools = prepare_conversation(req.conversation(), tools, tool_format,
                                                                native_tools)
        except ValueError as e:
            raise bad_request(e) from e
        if plan is not None:
            params = plan.apply(params)
        check_capacity(1)
        await compile_constraint(params)
        prompt_ids = await chat_prompt(conversation, req.add_generation_prompt, template_tools)
        base_id = P.random_id("chatcmpl")
        queued = await submit([prompt_ids], params, base_id, req.cache_salt)
        n = params.n
        top_n = req.top_logprobs or 0

        def finish_reason(c: CompletionOutput, num_calls: int) -> str | None:
            return "tool_calls" if num_calls and c.finish_reason == "stop" else c.finish_reason

        if not req.stream:
            (out,) = await collect(request, queued)
            choices = []
            for c in out.outputs:
                content, calls = (c.text, []) if plan is None else plan.parse(c.text)
                message = P.ChatResponseMessage(content=content, tool_calls=calls or None)
                choices.append(P.ChatChoice(
                    index=c.index, message=message, finish_reason=finish_reason(c, len(calls)),
                    logprobs=chat_logprobs(c.token_ids, list(c.logprobs or []), tokenizer, top_n)
                    if req.logprobs else None, stop_reason=c.stop_reason))
            return P.ChatCompletionResponse(id=base_id, model=model, choices=choices, usage=usage_of([out]))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        call_streams = {j: plan.stream() for j in range(n)} if plan is not None else {}
        created = P.ChatCompletionStreamResponse(id=base_id, model=model, choices=[]).created

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            body: dict[str, Any] = {"id": base_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": choices}
            if include_usage:
                body["usage"] = None
            return body

        # OpenAI opens every choice with the role and an empty content.
        preamble = [chunk([P.ChatStreamChoice(index=j, delta={"role": "assistant", "content": ""}).model_dump()
                           for j in range(n)])]

        def make_chunks(_: int, out: RequestOutput) -> list[dict[str, Any]]:
            result = []
            for c in out.outputs:
                if c.index in done:
                    continue
                text = _visible_text(c, params)
                if plan is None:
                    new = text[sent_text.get(c.index, 0):]
                    delta: dict[str, Any] = {"content": new} if new else {}
                else:  # tool calls: content and calls as each becomes certain
                    delta = call_streams[c.index].update(text, c.finish_reason is not None)
                if not delta and c.finish_reason is None:
                    continue
                start, ntok = sent_tokens.get(c.index, 0), len(c.token_ids)
                lps = chat_logprobs(c.token_ids[start:ntok], list(c.logprobs or [])[start:ntok], tokenizer, top_n) \
                    if req.logprobs else None
                sent_text[c.index], sent_tokens[c.index] = len(text), ntok
                if c.finish_reason is not None:
                    done.add(c.index)
                num_calls = call_streams[c.index].num_calls if plan is not None else 0
                result.append(chunk([P.ChatStreamChoice(
                    index=c.index, delta=delta, logprobs=lps, finish_reason=finish_reason(c, num_calls),
                    stop_reason=c.stop_reason).model_dump()]))
            return result

        return sse_response(stream_events(request, queued, make_chunks, preamble,
                                          chunk if include_usage else None))

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
        return {"version": pagoda.__version__}

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> P.TokenizeResponse:
        check_model(req.model)
        if req.messages is not None:
            try:
                conv = P.ChatCompletionRequest(messages=req.messages).conversation()
            except ValueError as e:
                raise bad_request(e) from e
            ids = await chat_prompt(conv, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await off_loop(core.tokenize, req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return P.TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=list(ids))

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        check_model(req.model)
        vocab = core.args.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        return P.DetokenizeResponse(prompt=await off_loop(tokenizer.decode, req.tokens, param="tokens"))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    return app
