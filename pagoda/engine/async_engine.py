"""AsyncEngine: drive one LLMEngine from asyncio code.

LLMEngine is not thread-safe, so exactly one background thread owns it: it runs step() in a
busy loop while there is work and sleeps on a condition variable when idle. Everything else
(add, abort, ...) reaches the engine as a command (the dataclasses below) on a queue that the worker drains
between steps.
Outputs travel back to the event loop with call_soon_threadsafe, one callback per step, into a
per-request asyncio.Queue that generate() reads.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagoda.distributed.errors import WorkerDiedError
from pagoda.engine.stats import EngineStats
from pagoda.engine.step_turns import StepTurns, build_then_serve
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.engine import LLMEngine
    from pagoda.engine.input_processor import InputProcessor, ProcessedRequest

logger = logging.getLogger(__name__)


class EngineMetricsHook(Protocol):
    """What the worker reports; pagoda.entrypoints.server.metrics implements it with prometheus_client."""

    def on_step(self, stats: EngineStats) -> None: ...

    def on_prompt(self, num_prompt_tokens: int) -> None: ...

    def on_generated(self, num_tokens: int) -> None: ...

    def on_finished(self, output: RequestOutput) -> None: ...

    def on_aborted(self) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine has shut down (or its worker died); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone; other requests go on. status 400: the request's own doing
    (a constraint that cannot compile or continue), its message is for the client; 500: logged server-side."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_tokens: int = 0  # generated tokens seen so far (all choices), for the generation counter
    finished: bool = False


_FINISHED = object()  # sentinel queued after a request's final output


# ---- the commands callers send the worker (applied between steps, in order) ------------------------------
@dataclass
class AddRequest:
    """Queue a request the input processor has checked; the worker resolves `accepted` (or fails it with
    add_processed's error) and then delivers the request's outputs to `stream`."""
    processed: ProcessedRequest
    request_id: str
    stream: _Stream
    accepted: asyncio.Future
    cache_salt: str | None = None
    client: str | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass
class Abort:
    """Stop a request and free its KV blocks; its stream ends."""
    request_id: str


@dataclass
class ResetPrefixCache:
    """Forget every cached prefix."""


@dataclass
class Shutdown:
    """Abort what is still in flight and stop the worker."""


Command = AddRequest | Abort | ResetPrefixCache | Shutdown


class AsyncEngine:
    def __init__(self, engine: "LLMEngine", metrics: EngineMetricsHook | None = None,
                 idle_poll_s: float = 1.0, step_turns: StepTurns | None = None) -> None:
        """`step_turns`: shared by the engines of one process (several models in one server), so that one of
        them steps at a time (step_turns.py)."""
        self.engine = engine
        self.metrics = metrics
        # Where a step runs: on the shared compute thread of several engines, else right here.
        self._run_step: Callable[[Callable[[], list[RequestOutput]]], list[RequestOutput]] = \
            step_turns.run if step_turns is not None else (lambda step: step())
        self.stats = EngineStats()
        self._idle_poll_s = idle_poll_s
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._streams: dict[str, _Stream] = {}  # touched by the worker only (after the add command)
        self._num_pending_adds = 0
        self._stopping = False
        self._deadline: float | None = None  # monotonic time at which draining aborts what is left
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._step_began: float | None = None  # monotonic start of the step under way, None between steps

    # ---- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def launch(cls, build: Callable[[], LLMEngine], metrics: EngineMetricsHook | None = None,
               step_turns: StepTurns | None = None) -> AsyncEngine:
        """Build the engine on the worker thread that will step it, and start it; raises what `build` raised.
        With `step_turns` (several engines), the build runs on a thread of its own and the steps on the
        shared compute thread (StepTurns).

        The process's OpenMP parallel regions then all come from one thread. libgomp keeps a pool of workers
        for each thread that ever opened a region, and once its pools hold more threads than there are cores
        it stops spinning at barriers: every region of a step then waits for a sleeping worker to wake.
        Loading and warming the model on the caller's thread (the server's event loop) would leave such a
        second pool behind."""
        def build_engine() -> AsyncEngine:
            engine = cls(step_turns.build(build) if step_turns is not None else build(), metrics,
                         step_turns=step_turns)
            engine._thread = threading.current_thread()
            return engine

        return build_then_serve("pagoda-engine", build_engine, lambda engine: engine._run())

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def input_processor(self) -> InputProcessor:
        """Tokenizer, chat template, checks and grammar compiles: the front every route goes through."""
        return self.engine.input_processor

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter against the model, from any thread; ValueError naming it otherwise."""
        self.engine.check_lora(lora_request)

    @property
    def step_seconds(self) -> float:
        """How long the step under way has run (0 between steps): a rank that stopped shows here first."""
        began = self._step_began
        return 0.0 if began is None else time.monotonic() - began

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._num_pending_adds

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled: queued in the scheduler or still in the command queue."""
        return self.stats.num_waiting + self._num_pending_adds

    def begin_shutdown(self, timeout: float) -> None:
        """Stop taking requests now; the worker aborts whatever is still in flight `timeout` s from now.

        Thread-safe and idempotent (a second call never extends the deadline). The server calls it as
        soon as SIGTERM arrives, so the drain takes `timeout` once, whichever handlers are still waiting.
        """
        with self._cond:
            self._stopping = True
            deadline = time.monotonic() + max(0.0, timeout)
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify_all()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout` s, abort the rest, stop."""
        self.begin_shutdown(timeout)
        assert self._deadline is not None
        # The worker aborts at the deadline; allow it a moment to deliver those errors.
        while self.num_in_flight and time.monotonic() < self._deadline + 1.0 and self._thread is not None \
                and self._thread.is_alive():
            await asyncio.sleep(0.05)
        with self._cond:
            # The worker aborts whatever is left once it sees this; then it exits.
            self._commands.append(Shutdown())
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # ---- requests ------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None, cache_salt: str | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a request; raises ValueError (from the engine's validation) for bad input."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return (await self.add_requests([(prompt, rid)], params, cache_salt))[0]

    async def add_requests(self, prompts: list[tuple[str | list[int], str]], params: SamplingParams,
                           cache_salt: str | None = None, client: str | None = None,
                           priority: int = 0, lora_request: LoRARequest | None = None,
                           ) -> list[tuple[str, asyncio.Queue]]:
        """Queue every (prompt, request id) at once, in one hand-off to the worker (which adds them all before
        its next step), or none: where one is refused, the others are aborted and its error is raised.
        Cancelled (the client left), every one of them is aborted."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is dead: {self._dead}")
        if self._stopping:
            raise EngineDeadError("server is shutting down")
        # Validation reads every token id: off the event loop, before anything is queued.
        processed = await asyncio.to_thread(lambda: [self.input_processor.process(p, params) for p, _ in prompts])
        loop = asyncio.get_running_loop()
        adds = [AddRequest(proc, rid, _Stream(loop), loop.create_future(), cache_salt, client, priority, lora_request)
                for proc, (_, rid) in zip(processed, prompts)]
        with self._cond:
            # Checked again under the lock: a worker dying after the check above must not strand these adds.
            if self._dead is not None or self._stopping:
                raise EngineDeadError("engine is not accepting requests")
            self._num_pending_adds += len(adds)
            self._commands.extend(adds)
            self._cond.notify_all()
        try:
            # Every future resolves (or fails) in the same pass of the worker; the first error is raised.
            results = await asyncio.gather(*(a.accepted for a in adds), return_exceptions=True)
        except asyncio.CancelledError:
            for a in adds:  # queued behind the adds, so none can leak
                self.abort(a.request_id)
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            for a in adds:
                self.abort(a.request_id)
            raise error
        return [(a.request_id, a.stream.queue) for a in adds]

    def reset_prefix_cache(self) -> None:
        """Thread-safe; applied by the worker between steps."""
        with self._cond:
            self._commands.append(ResetPrefixCache())
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the worker frees the request's KV blocks before its next step."""
        with self._cond:
            self._commands.append(Abort(request_id))
            self._cond.notify_all()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs as the request progresses; the last has .finished.

        If the consumer stops early (client disconnect, cancellation, aclose) the request is aborted.
        """
        rid, queue = await self.add_request(prompt, params, request_id)
        async for out in self.stream(rid, queue):
            yield out

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued by add_request (split so callers can validate everything first)."""
        finished = False
        try:
            while True:
                item = await queue.get()
                # Outputs are cumulative: a slow consumer only needs the newest one.
                while not queue.empty() and item is not _FINISHED and not isinstance(item, BaseException):
                    nxt = queue.get_nowait()
                    if nxt is _FINISHED:
                        queue.put_nowait(nxt)
                        break
                    item = nxt
                if item is _FINISHED:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # ---- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._publish_stats()  # gauges show the idle engine (free blocks) before the first request
            while True:
                with self._cond:
                    while (not self._commands and not self.engine.has_unfinished_requests()
                           and not self._stopping):
                        self._cond.wait(self._idle_poll_s)
                    commands, self._commands = self._commands, []
                if self._handle_commands(commands):
                    return
                if self._deadline is not None and time.monotonic() >= self._deadline and self._streams:
                    self._abort_all("the server shut down before the request finished (drain timeout)")
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self._stopping and not self._commands:
                    # Draining with nothing left: keep sleeping until shutdown() sends "shutdown".
                    with self._cond:
                        if not self._commands:
                            self._cond.wait(0.05)
        except BaseException as e:  # the worker itself broke: fail everything, refuse new work
            logger.exception("engine worker died")
            self._dead = e
            self._fail_all(e)
            with self._cond:
                for cmd in self._commands:
                    if isinstance(cmd, AddRequest):
                        self._reject(cmd, EngineDeadError(f"engine is dead: {e}"))
                self._commands = []
        finally:
            with contextlib.suppress(Exception):  # stop the other tensor-parallel ranks, if any
                self.engine.close()

    def _handle_commands(self, commands: list[Command]) -> bool:
        """Apply queued commands; True means shut down now."""
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                try:
                    req = self.engine.add_processed(cmd.processed, cmd.request_id, cmd.cache_salt, cmd.client,
                                                   cmd.priority, cmd.lora_request)
                except Exception as e:  # ValueError for bad input: the caller gets it
                    self._reject(cmd, e)
                    continue
                self._streams[cmd.request_id] = cmd.stream
                with self._cond:
                    self._num_pending_adds -= 1
                self._hook("on_prompt", len(req.prompt_token_ids))
                cmd.stream.loop.call_soon_threadsafe(_resolve, cmd.accepted, None)
            elif isinstance(cmd, Abort):
                stream = self._streams.pop(cmd.request_id, None)
                self.engine.abort_request(cmd.request_id)
                if stream is not None:  # still in flight: its client left (or its handler gave up)
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _FINISHED)
                    self._hook("on_aborted")
            elif isinstance(cmd, ResetPrefixCache):
                self.engine.reset_prefix_cache()
            elif isinstance(cmd, Shutdown):
                self._abort_all("the server shut down before the request finished")
                return True
        if commands:
            self._publish_stats()
        return False

    def _reject(self, cmd: AddRequest, error: BaseException) -> None:
        with self._cond:
            self._num_pending_adds -= 1
        cmd.stream.loop.call_soon_threadsafe(_reject, cmd.accepted, error)

    def _abort_all(self, reason: str) -> None:
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._hook("on_aborted")
        self._fail_all(EngineDeadError(reason))
        self._publish_stats()

    def _timed_step(self) -> list[RequestOutput]:
        self._step_began = time.monotonic()  # once its turn came: the step timeout counts the step alone
        try:
            return self.engine.step()
        finally:
            self._step_began = None

    def _step(self) -> None:
        try:
            # step() fails the requests a failure belongs to and returns; reaching the handler below
            # means a bug in the engine's own recovery.
            outputs = self._run_step(self._timed_step)
        except WorkerDiedError:  # the engine cannot go on: _run fails everything and refuses new work
            raise
        except Exception:
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
            for rid in list(self._streams):
                with contextlib.suppress(Exception):
                    self.engine.abort_request(rid)
            # Never another request's error text: that would leak one tenant's input to the others.
            self._fail_all(RequestFailedError("internal error in the engine step"))
            self._publish_stats()
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        generated = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            num = sum(len(c.token_ids) for c in out.outputs)
            generated += num - stream.num_tokens
            stream.num_tokens = num
            items = by_loop.setdefault(stream.loop, [])
            if out.error is not None:  # the engine failed this request alone
                items.append((stream.queue, RequestFailedError(out.error, out.error_status)))
            else:
                items.append((stream.queue, out))
            if out.finished:
                del self._streams[out.request_id]
                items.append((stream.queue, _FINISHED))
                self._hook("on_finished", out)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        if generated:
            self._hook("on_generated", generated)
        self._publish_stats()

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            with contextlib.suppress(RuntimeError):  # loop already closed
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _publish_stats(self) -> None:
        self.stats = self.engine.engine_stats()
        self._hook("on_step", self.stats)

    def _hook(self, name: str, *args: Any) -> None:
        # A metrics bug must never kill the worker thread.
        if self.metrics is None:
            return
        try:
            getattr(self.metrics, name)(*args)
        except Exception:
            logger.exception("metrics hook %s failed", name)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
