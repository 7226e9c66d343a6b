"""Grammar compiles in worker processes that can be killed.

A grammar library's compiler is native code that cannot be interrupted: a hostile constraint can run for
minutes or grow without end, and a thread running it can only be waited for. A server therefore compiles in
worker processes of its own, and kills the one whose compile runs past its time limit, grows past its memory
limit, or is no longer wanted (its clients left, the server stops). The compiled grammar comes back as the
library's own serialized form (backend.compile_serialized / deserialize), never as a pickle. A killed worker
is replaced on the next compile; a worker exits when the server's process is gone.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import psutil

from pagoda.spawn import main_module_not_rerun
from pagoda.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)
_POLL_S = 0.02


class CompileBudgetError(ValueError):
    """A compile went past its time or memory limit: the constraint's fault, a 400 naming the limit."""


class CompileCancelled(Exception):
    """Nobody wants the compile any more, or the server is stopping; its worker was killed."""

    def __init__(self, message: str = "the grammar compile was cancelled (the server is stopping)") -> None:
        super().__init__(message)


@dataclass(frozen=True)
class CompileBudget:
    timeout_s: float | None = None
    memory_bytes: int | None = None  # resident memory one compile may add to its worker


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build the backends: the tokenizer as its JSON text, not a pickle."""
    tokenizer_json: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]


def _die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the parent process is gone, even in the middle of a compile. (PR_SET_PDEATHSIG would
    fire when the parent's *thread* that started this process ends, and compiles start from passing threads.)"""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagoda-grammar-parent-watch", daemon=True).start()


def _worker_main(conn: Connection, spec: WorkerSpec, parent_pid: int) -> None:
    """Compile what the parent sends, one at a time: ("start", rss) once the backend is built (the memory the
    compile itself adds is measured from there), then ("ok", text) or ("error", message)."""
    _die_with_parent(parent_pid)
    from tokenizers import Tokenizer

    from pagoda.structured.backend import make_backend

    tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    backends: dict[str, Any] = {}
    me = psutil.Process()
    while True:
        try:
            name, params = conn.recv()
        except (EOFError, OSError):
            return
        try:
            backend = backends.get(name)
            if backend is None:
                backend = backends[name] = make_backend(name, tokenizer, spec.vocab_size, list(spec.stop_token_ids))
            conn.send(("start", me.memory_info().rss))
            conn.send(("ok", backend.compile_serialized(params)))
        except ValueError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # noqa: BLE001 - the library's failure on the client's constraint: theirs to see
            conn.send(("error", f"structured_outputs: the {params.kind} does not compile: {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that runs torch threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, os.getpid()), name="pagoda-grammar-compile",
                                daemon=True)
        with main_module_not_rerun():
            self.proc.start()
        child.close()
        self._ps = psutil.Process(self.proc.pid)
        self.closed = False  # killed by CompileWorkers.close: its compile is cancelled, not failed
        self._kill_lock = threading.Lock()
        self._killed = False

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """Idempotent, and safe from two threads at once (the compile's own and CompileWorkers.close)."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            with contextlib.suppress(OSError):
                self.conn.close()

    def _died(self, params: StructuredOutputsParams) -> NoReturn:
        self.kill()
        if self.closed:
            raise CompileCancelled()
        raise ValueError(f"structured_outputs: the grammar compiler process died compiling the {params.kind} "
                         f"(exit code {self.proc.exitcode})")

    def compile(self, backend: str, params: StructuredOutputsParams, budget: CompileBudget,
                cancelled: Callable[[], bool]) -> str:
        """The serialized grammar; kills this worker (and raises) where the budget or the caller says so."""
        self.conn.send((backend, params))
        started: float | None = None
        baseline = 0
        while True:
            if self.conn.poll(_POLL_S):
                try:
                    kind, value = self.conn.recv()
                except (EOFError, OSError):
                    self._died(params)
                if kind == "start":
                    started, baseline = time.monotonic(), int(value)
                    continue
                if kind == "ok":
                    return str(value)
                raise ValueError(str(value))
            if not self.proc.is_alive():
                self._died(params)
            if cancelled():
                self.kill()
                raise CompileCancelled()
            if started is None:
                continue  # still building the backend: not the constraint's time
            if budget.timeout_s is not None and time.monotonic() - started > budget.timeout_s:
                self.kill()
                raise CompileBudgetError(f"structured_outputs: the {params.kind} did not compile within "
                                         f"{budget.timeout_s:g} s (--structured-outputs-compile-timeout)")
            if budget.memory_bytes is not None:
                try:
                    grown = self._ps.memory_info().rss - baseline
                except psutil.Error:
                    continue  # exiting: the next poll sees it
                if grown > budget.memory_bytes:
                    self.kill()
                    raise CompileBudgetError(
                        f"structured_outputs: the {params.kind} needs more than {budget.memory_bytes / 2**20:.0f} "
                        "MiB to compile (--structured-outputs-compile-memory)")


class CompileWorkers:
    """Up to `max_workers` compile processes, started as compiles need them. Thread-safe: each calling thread
    holds one worker for the length of its compile."""

    def __init__(self, spec: WorkerSpec, max_workers: int, budget: CompileBudget) -> None:
        self.spec, self.max_workers, self.budget = spec, max_workers, budget
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._cond = threading.Condition()
        self._closed = False

    def prestart(self) -> None:
        """Start one worker in the background, so the first compile does not wait for Python to start."""
        def start() -> None:
            with self._cond:
                if self._closed or self._all:
                    return
                worker = _Worker(self.spec)
                self._all.add(worker)
                self._idle.append(worker)
                self._cond.notify()

        threading.Thread(target=start, name="pagoda-grammar-prestart", daemon=True).start()

    def compile(self, backend: str, params: StructuredOutputsParams, cancelled: Callable[[], bool]) -> str:
        worker = self._checkout(cancelled)
        try:
            return worker.compile(backend, params, self.budget, cancelled)
        finally:
            self._checkin(worker)

    def close(self) -> None:
        """Kill every worker (a compile under way raises in its thread); later compiles are refused."""
        with self._cond:
            self._closed = True
            workers, self._idle = list(self._all), []
            self._all.clear()
            self._cond.notify_all()
        for w in workers:
            w.closed = True
            w.kill()

    def _checkout(self, cancelled: Callable[[], bool]) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise CompileCancelled()
                if cancelled():
                    raise CompileCancelled()
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive:
                        return worker
                    self._all.discard(worker)
                    worker.kill()
                if len(self._all) < self.max_workers:
                    worker = _Worker(self.spec)
                    self._all.add(worker)
                    return worker
                self._cond.wait(0.1)

    def _checkin(self, worker: _Worker) -> None:
        with self._cond:
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                self._all.discard(worker)
                worker.kill()
            self._cond.notify()
