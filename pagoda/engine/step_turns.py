"""StepTurns: the engines of one process take turns at stepping, first come first served.

Several models in one server each have their own engine and step loop, but torch's compute threads are one
pool per process and a step already spreads its work over every core. Two steps at once would run two teams of
threads on the same cores, each parallel region waiting for its slowest thread; one step at a time gives each
step every core. The turns are a ticket lock, so a busy engine cannot starve an idle one that wakes up:
a plain lock goes back to the thread that just released it more often than not.
"""
from __future__ import annotations

import threading
from types import TracebackType


class StepTurns:
    """A FIFO lock: `with turns:` around one engine step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()
