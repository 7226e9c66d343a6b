"""What the /v1 handlers share (serving_completions.py, serving_chat.py): checks, off-loop work, queueing and
collecting requests, the SSE stream, and the per-choice bookkeeping of a streamed response."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagoda.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError, bad_request, error_body
from pagoda.entrypoints.server.serving_lora import LoRAAdapters
from pagoda.entrypoints.server.settings import ServerSettings
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured.compile_workers import CompileCancelled

# The sampling fields a rendered prompt carries (all plain values).
RENDERED_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                            "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop",
                            "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens")
logger = logging.getLogger(__name__)


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


def visible_text(c: CompletionOutput, params: SamplingParams) -> str:
    """Text safe to stream now. While running, hold back the last len(stop)-1 characters: a stop string
    completed by a later token truncates the text there, and what was sent cannot be taken back."""
    if c.finish_reason is not None or not params.stop_strings:
        return c.text
    hold = max(len(s) for s in params.stop_strings) - 1
    return c.text[: max(0, len(c.text) - hold)]


# Characters JSON leaves raw that many line readers (Python's str.splitlines among them) take for line ends:
# escaped, so an event's data stays on one line whatever text a client sent or the model wrote.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _event_json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else _event_json(payload)
    return f"data: {data}\n\n"


def text_of_parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a string or a list of text parts of the given `kinds` (images and files are not read by
    this engine); ValueError naming the first part that is not text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a {kind or 'malformed'} part where only text parts are read here")
        parts.append(part["text"])
    return "".join(parts)


def named_sse(event: dict[str, Any]) -> str:
    """A server-sent event named by its `type` (the Responses and Messages APIs' streams)."""
    return f"event: {event['type']}\ndata: {_event_json(event)}\n\n"


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


def fair_share_client(body: P._SamplingFields, request: Request) -> str:
    """Whose share of the engine's seats a request takes: its `user` (OpenAI's end-user id), else the peer
    address. Requests of one client share one share however many connections they open."""
    if body.user:
        return f"user:{body.user}"
    return f"peer:{request.client.host if request.client is not None else '-'}"


async def _until_disconnected(request: Request) -> None:
    """Return when the client goes away. If the channel itself fails, wait forever rather than abort."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    except Exception:
        await asyncio.Event().wait()


@dataclass
class SentChoice:
    """How much of one choice a stream has sent: characters of visible text, tokens with their logprobs,
    and whether it ended. Completions and chat keep one per choice index."""
    text: int = 0
    tokens: int = 0
    done: bool = False

    def advance(self, text: str, num_tokens: int, finished: bool) -> int:
        """Record `text` (all that is visible now) and `num_tokens` as sent; return the first new token."""
        start = self.tokens
        self.text, self.tokens, self.done = len(text), num_tokens, finished
        return start


class Serving:
    """The shared plumbing of the /v1 handlers over one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.inputs = engine.input_processor
        self.tokenizer = self.inputs.tokenizer
        self.names = settings.served_model_names
        self._compile_waiters: dict[Future, int] = {}  # requests awaiting each grammar compile
        self.loras = LoRAAdapters(engine, self.names)  # adapters chosen by the `model` field
        for name, path in settings.lora_modules.items():
            self.loras.load_now(name, path)

    def retry_later(self, message: str) -> APIError:
        """A 503 that tells the client when to try again (shutting down, a full queue, a dead engine)."""
        return APIError(503, message, headers={"Retry-After": str(self.settings.retry_after_s)})

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.names[0]
        if model not in self.names and model not in self.settings.model_aliases and model not in self.loras:
            served = ", ".join([*self.names, *self.loras.adapters])
            raise APIError(404, f"The model `{model}` does not exist. Served: {served}", "model")
        return model

    def check_capacity(self, num_new: int) -> None:
        if not self.engine.is_running:
            raise self.retry_later("the server is shutting down")
        limit = self.settings.max_waiting_requests
        if limit is not None and num_new > limit:  # would never fit: retrying cannot help
            raise APIError(400, f"{num_new} prompts in one request exceed the server's queue "
                                f"(--max-waiting-requests {limit}); split the batch", "prompt")
        if limit is not None and self.engine.num_waiting + num_new > limit:
            raise self.retry_later(f"too many waiting requests (limit {limit}); retry later")

    async def off_loop(self, fn: Callable[..., Any], *args: Any, param: str = "prompt") -> Any:
        """Tokenizing and templating take up to seconds on large input: a worker thread does them, so
        streams and /health never wait on one request's text. Their ValueErrors are 400s."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), param) from e
        except UnicodeError as e:
            raise APIError(400, f"{param}: not valid Unicode text ({e})", param) from e

    async def compile_constraint(self, params: SamplingParams, request: Request) -> None:
        """A grammar compiles in the engine's compile workers (cached by its text), awaited here without holding
        any thread: a bad one, or one past its time or memory budget, is this request's 400, and the engine
        then finds it ready, so the step loop never waits on a compiler. When the last client waiting for a
        compile leaves, the compile is cancelled (its worker process killed)."""
        if params.structured_outputs is None:
            return
        future = self.inputs.start_compile(params)
        assert future is not None
        waiters = self._compile_waiters
        waiters[future] = waiters.get(future, 0) + 1
        gone = asyncio.create_task(_until_disconnected(request))
        left = True  # also where this handler itself is cancelled
        wrapped = asyncio.wrap_future(future)
        wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())  # read below, from `future`
        try:
            await asyncio.wait({wrapped, gone}, return_when=asyncio.FIRST_COMPLETED)
            left = not future.done()
        finally:
            gone.cancel()
            waiters[future] -= 1
            if not waiters[future]:
                del waiters[future]
                if left:  # nobody else waits for it (the loop's thread: no race with a new waiter)
                    future.cancel()
        if left:
            raise APIError(499, "client closed the request", "response_format")
        try:
            future.result()
        except ValueError as e:
            raise APIError(400, str(e), "response_format") from e
        except (CompileCancelled, CancelledError) as e:  # the server is stopping
            raise self.retry_later(str(e) or "the grammar compile was cancelled") from e

    def tokenize_all(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self.inputs.tokenize(p) if isinstance(p, str) else p for p in prompts]

    async def submit(self, prompts: list[list[int]], params: SamplingParams, base_id: str,
                     body: P._SamplingFields, request: Request) -> list[tuple[str, asyncio.Queue]]:
        """Queue every prompt in one hand-off to the engine, or none: a bad one raises a 400. A client that
        leaves meanwhile (`request`) has them all aborted."""
        ids = [(prompt, base_id if len(prompts) == 1 else f"{base_id}-{i}") for i, prompt in enumerate(prompts)]
        lora = self.loras.get(getattr(body, "model", None))
        adding = asyncio.create_task(self.engine.add_requests(ids, params, body.cache_salt,
                                                              fair_share_client(body, request), body.priority,
                                                              lora))
        gone = asyncio.create_task(_until_disconnected(request))
        try:
            done, _ = await asyncio.wait({adding, gone}, return_when=asyncio.FIRST_COMPLETED)
            if adding not in done:
                adding.cancel()  # aborts every one of them
                raise APIError(499, "client disconnected")
            return adding.result()
        except ValueError as e:
            raise bad_request(e) from e
        except EngineDeadError as e:
            raise self.retry_later(str(e)) from e
        finally:
            if not adding.done():  # this handler was cancelled: so are its adds
                adding.cancel()
            gone.cancel()

    async def collect(self, request: Request, queued: list[tuple[str, asyncio.Queue]]) -> list[RequestOutput]:
        """Final outputs of every request; a client that goes away, or a cancelled handler, aborts them all."""
        async def last(rid: str, q: asyncio.Queue) -> RequestOutput | None:
            final = None
            async for out in self.engine.stream(rid, q):
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
                self.engine.abort(rid)
        for t in tasks:
            error = t.exception()
            if isinstance(error, EngineDeadError):
                raise self.retry_later(str(error)) from error
            if isinstance(error, RequestFailedError) and error.status == 400:  # its own constraint
                raise APIError(400, str(error), "response_format") from error
            if error is not None:  # the engine failed this request alone: a 500 for it
                logger.error("request %s failed: %s", queued[0][0] if queued else "?", error)
                raise APIError(500, f"internal error while generating: {error}") from error
        results = [t.result() for t in tasks]
        if any(r is None or not r.finished for r in results):
            raise self.retry_later("the request was aborted (server shutting down)")
        return results  # type: ignore[return-value]

    def usage_of(self, outs: list[RequestOutput]) -> P.Usage:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    async def stream_events(self, request: Request, queued: list[tuple[str, asyncio.Queue]],
                            make_chunks: Callable[[int, RequestOutput], list[dict[str, Any]]],
                            preamble: list[dict[str, Any]],
                            empty_chunk: Callable[[list[dict[str, Any]]], dict[str, Any]] | None,
                            frame: Callable[[dict[str, Any]], str] = _sse,
                            error: Callable[[int, str], dict[str, Any]] = error_body,
                            done: str | None = "[DONE]") -> AsyncIterator[str]:
        """The SSE stream of `queued`'s outputs, each turned into chunks by `make_chunks` and written by `frame`;
        a failure ends it with `error`'s body, and `done` (OpenAI's "[DONE]"; None: nothing) closes it."""
        streams = [self.engine.stream(rid, q) for rid, q in queued]
        finals: dict[int, RequestOutput] = {}
        watch = asyncio.create_task(_until_disconnected(request))
        def on_disconnect(t: asyncio.Task) -> None:
            if not t.cancelled():
                for rid, _ in queued:
                    self.engine.abort(rid)

        watch.add_done_callback(on_disconnect)
        merged = _merge(streams)
        try:
            for chunk in preamble:
                yield frame(chunk)
            async for i, out in merged:
                if out.finished:
                    finals[i] = out
                for chunk in make_chunks(i, out):
                    yield frame(chunk)
            if len(finals) < len(queued):
                raise EngineDeadError("the request was aborted (server shutting down)")
            if empty_chunk is not None:  # stream_options.include_usage: a last chunk with no choices
                body = empty_chunk([])
                body["usage"] = self.usage_of(list(finals.values())).model_dump()
                yield frame(body)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except EngineDeadError as e:
            yield frame(error(503, str(e)))
        except RequestFailedError as e:
            if e.status != 400:
                logger.error("streaming request %s failed: %s", queued[0][0] if queued else "?", e)
            yield frame(error(e.status, str(e) if e.status == 400 else f"internal error while generating: {e}"))
        except Exception as e:
            logger.exception("streaming request %s failed", queued[0][0] if queued else "?")
            yield frame(error(500, f"internal error while generating: {e}"))
        finally:
            watch.cancel()
            with contextlib.suppress(Exception):
                await merged.aclose()
            for rid, _ in queued:  # no-op for finished requests; frees blocks of the rest at once
                self.engine.abort(rid)
        if done is not None:
            yield _sse(done)

    def sse_response(self, gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def rendered(self, request_id: str, token_ids: list[int], params: SamplingParams, model: str, stream: bool,
                 cache_salt: str | None) -> dict[str, Any]:
        """A prompt as vLLM's render endpoints return it (its token-in GenerateRequest): what routers that place
        requests by their tokens (vllm-router's cache_aware) ask each worker for."""
        return {"request_id": request_id, "token_ids": token_ids, "model": model, "stream": stream,
                "cache_salt": cache_salt, "token_offsets": None,
                "sampling_params": {k: getattr(params, k) for k in RENDERED_SAMPLING_FIELDS}}

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        def render() -> list[int]:
            try:
                return self.inputs.tokenize_chat(messages, add_generation_prompt, tools)
            except (ValueError, UnicodeError):
                raise
            except Exception as e:  # a template that rejects the conversation (roles out of order, ...)
                raise ValueError(f"messages: the chat template rejected them: {e}") from e

        return await self.off_loop(render, param="messages")
