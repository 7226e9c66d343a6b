"""Connections as an exposed server must hold them: a cap on how many are open, a deadline for a request's
headers, and logs that a flood cannot fill.

uvicorn bounds neither the number of connections (its `limit_concurrency` answers 503 but keeps every socket)
nor the time a client may take to send its headers (its keep-alive timer runs only between requests), so a
slow-header client (slowloris) holds a descriptor as long as it likes and enough of them starve the process
of descriptors. The protocol below closes a connection at once when the cap is reached, and closes one whose
request headers have not arrived within the deadline; the body has its own (middleware.BodyLimitMiddleware).
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# Descriptors kept back from the connection cap: model files, the engine's pipes, worker sockets, logs.
RESERVED_DESCRIPTORS = 256


def raise_descriptor_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (as vLLM does); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may forbid it: keep what we have
            pass
    return soft


def default_max_connections() -> int:
    return max(16, raise_descriptor_limit() - RESERVED_DESCRIPTORS)


def guarded_protocol(max_connections: int, header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection cap and a header deadline (pass as uvicorn.Config(http=...))."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                # Closed before it is counted or read: the descriptor is free again at once.
                logger.warning("connection refused: %d connections open (--max-connections)", len(self.connections))
                transport.abort()
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.transport is None:  # refused in connection_made
                return
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._headers_overdue)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_overdue(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:  # no request under way: headers never came
                logger.info("closing a connection from %s: no request headers within %g s (--header-timeout)",
                            self.client[0] if self.client else "?", header_timeout)
                self.transport.close()

    return GuardedH11Protocol


class RateLimitFilter(logging.Filter):
    """Let one record of each kind (logger, message template) through per `interval` seconds; the next one
    says how many were dropped. A flood of refused connections or accept errors then costs a line per interval."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, Any], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.CRITICAL:
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        last, dropped = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval:
            self._last[key] = (last, dropped + 1)
            return False
        if len(self._last) > 4096:  # templates are few; keys from formatted strings must not grow without end
            self._last.clear()
        self._last[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} similar message(s) dropped in the last {now - last:.0f} s)"
        return True


def rate_limit_logs(interval: float = 10.0) -> None:
    """Rate-limit the loggers a connection flood writes to: ours, uvicorn's and asyncio's (accept errors)."""
    limiter = RateLimitFilter(interval)
    for name in ("uvicorn.error", "asyncio", __name__):
        logging.getLogger(name).addFilter(limiter)
