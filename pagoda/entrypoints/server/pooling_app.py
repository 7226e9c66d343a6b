"""`pagoda serve --task embed|score`: the pooling routes (serving_pooling.py) over one pooling model and its
dynamic batcher, with the chat server's middlewares, error shapes, health, /v1/models and /metrics. No paged
engine is loaded."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest

import pagoda
from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import install_error_handlers
from pagoda.entrypoints.server.metrics import CONTENT_TYPE
from pagoda.entrypoints.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from pagoda.entrypoints.server.openapi import install_openapi
from pagoda.entrypoints.server.serving_pooling import PoolingServing, pooling_router
from pagoda.entrypoints.server.settings import ServerSettings


def create_pooling_app(pooling: PoolingServing, settings: ServerSettings,
                       registry: CollectorRegistry | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pooling.batcher.stop()

    app = FastAPI(title="pagoda", version=pagoda.__version__, lifespan=lifespan)
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:  # outermost, as in app.py
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    install_error_handlers(app)
    app.include_router(pooling_router(pooling))
    runner = pooling.runner

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=name, root=settings.model_root or name,
                                             max_model_len=runner.max_model_len) for name in pooling.names])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagoda.__version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": pooling.batcher.num_waiting}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry) if registry is not None else b"", media_type=CONTENT_TYPE)

    return app


def build_pooling(model: str | None, kwargs: dict, names: list[str], aliases: list[str],
                  registry: CollectorRegistry) -> PoolingServing:
    """Load a pooling model (PoolingConfig from the engine's flags) and start its batcher."""
    from pagoda.config import PoolingConfig
    from pagoda.engine.pooling_batcher import PoolingBatcher
    from pagoda.entrypoints.server.metrics import PoolingMetrics
    from pagoda.executor.pooling_runner import PoolingRunner

    config = PoolingConfig.from_kwargs(model, **kwargs)
    metrics = PoolingMetrics(registry, names[0])
    batcher = PoolingBatcher.launch(lambda: PoolingRunner.from_config(config), config, metrics)
    return PoolingServing(batcher, names, aliases, metrics)


def serve_pooling(args: Any, settings_kwargs: dict) -> int:
    """Run the pooling-only server of `pagoda serve --task embed|score` until a signal stops it."""
    import logging
    import os
    import sys

    import uvicorn

    from pagoda.entrypoints.engine_args import engine_kwargs
    from pagoda.entrypoints.server import connections
    from pagoda.entrypoints.server.args import served_names
    from pagoda.model.default_model import DEFAULT_EMBEDDING_NAME

    names, aliases = served_names(args.model, args.served_model_name)
    if args.model is None and not args.served_model_name:
        names = [DEFAULT_EMBEDDING_NAME]
    registry = CollectorRegistry(auto_describe=True)
    pooling = build_pooling(args.model, {**engine_kwargs(args), "max_queue_delay_ms": args.max_queue_delay_ms,
                                         "classifier_from_token": args.classifier_from_token},
                            names, aliases, registry)
    settings = ServerSettings(served_model_names=names, model_aliases=aliases,
                              model_root=args.model or DEFAULT_EMBEDDING_NAME, **settings_kwargs)
    app = create_pooling_app(pooling, settings, registry)
    max_connections = args.max_connections or connections.default_max_connections()
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               access_log=args.access_log,
                               http=connections.guarded_protocol(max_connections, args.header_timeout),
                               timeout_graceful_shutdown=int(args.drain_timeout) + 2)
    server = uvicorn.Server(uv_config)
    print(f"pagoda: serving {names[0]} ({args.task}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.run()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if server.started else 1)
