"""StepTurns: the engines of one process take turns at stepping, first come first served, on one thread.

Several models in one server each have their own engine and step loop, but torch's compute threads are one
pool per process and a step already spreads its work over every core. Two steps at once would run two teams of
threads on the same cores, each parallel region waiting for its slowest thread; one step at a time gives each
step every core. And the steps all run on one compute thread: libgomp keeps a pool of workers for each thread that
opens parallel regions, and once its pools hold more threads than there are cores it stops spinning at barriers,
so every region would wait for a sleeping worker to wake (AsyncEngine.launch). An engine is built on a thread that
ends with its build, which takes its pool along. The queue is FIFO, so a busy engine cannot starve an idle one
that wakes up.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class StepTurns:
    """`run(fn)`: call `fn` on the compute thread, after the calls queued before it; return or raise its result."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="pagoda-compute", daemon=True)
                self._thread.start()
        done: Future[object] = Future()
        self._calls.put((fn, done))
        return done.result()  # type: ignore[return-value]

    @staticmethod
    def build(fn: Callable[[], T]) -> T:
        """Call `fn` (an engine's build) on a thread of its own that ends with it, and return or raise its result: the
        other engines go on stepping meanwhile, and the thread's pool of OpenMP workers ends with it."""
        return build_then_serve("pagoda-build", fn, lambda built: None)

    def _serve(self) -> None:
        while True:
            fn, done = self._calls.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                done.set_exception(e)


def build_then_serve(name: str, build: Callable[[], T], serve: Callable[[T], None]) -> T:
    """Start a daemon thread `name` that calls `build()`, then `serve(built)`: the OpenMP regions of both open from
    that one thread. Returns what was built once it is; raises what `build` raised, once the thread has ended."""
    built: Future[T] = Future()

    def main() -> None:
        try:
            result = build()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            built.set_exception(e)
            return
        built.set_result(result)
        serve(result)

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    try:
        return built.result()
    except BaseException:
        thread.join()
        raise
