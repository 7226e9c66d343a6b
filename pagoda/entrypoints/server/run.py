"""Run the server's ASGI app under uvicorn until SIGTERM or Ctrl-C: connections guarded (connections.py), the
engine drained from the signal on, and the process left at once when every client has its answer."""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def run_server(app: Any, args: argparse.Namespace, begin_shutdown: Callable[[float], None], label: str) -> int:
    """Run `app` under uvicorn until SIGTERM or Ctrl-C; `begin_shutdown(drain_timeout)` runs at the signal."""
    import uvicorn

    from pagoda.entrypoints.server import connections

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # The drain clock starts at the signal: the engine aborts what is left at drain_timeout, so
            # waiting handlers answer 503 then, rather than uvicorn waiting drain_timeout for them first
            # and the engine waiting again after.
            begin_shutdown(args.drain_timeout)
            super().handle_exit(sig, frame)

    # uvicorn's own limit is a backstop: by then the engine has ended every request.
    max_connections = args.max_connections or connections.default_max_connections()
    connections.rate_limit_logs()
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               access_log=args.access_log,
                               http=connections.guarded_protocol(max_connections, args.header_timeout),
                               timeout_graceful_shutdown=math.ceil(args.drain_timeout) + 2)
    server = Server(uv_config)
    # uvicorn catches SIGINT/SIGTERM, shuts down gracefully (stop accepting, wait for in-flight requests,
    # then our lifespan drains the engine) and finally re-raises the signal to the handler that was
    # installed before it started. Installing no-op handlers here turns that re-raise into exit code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    print(f"pagoda: serving {label} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.run()
    code = 0 if server.started else 1
    # The engine has stopped and every client has its answer. Tearing the interpreter down (freeing the
    # model and the KV pool, torch's finalizers) takes seconds more, which a supervisor's
    # SIGTERM grace period would spend on nothing: flush and leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
