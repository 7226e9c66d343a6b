"""`pagoda serve [MODEL]`: load the engine, then run the OpenAI-compatible app under uvicorn; with
--data-parallel-size N, N such servers behind vllm-router instead (data_parallel.py); with several models
(--model twice, --models-dir), one server for all of them (multi_model.py)."""
from __future__ import annotations

import argparse
import logging
import os

from pagoda.entrypoints.server.args import add_arguments, served_names, server_settings
from pagoda.entrypoints.server.run import run_server

__all__ = ["add_arguments", "main"]  # the `serve` command (entrypoints/cli.py): its flags and its body


def main(args: argparse.Namespace) -> int:
    from pagoda.config import EngineConfig, server_api_key
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.engine.engine import LLMEngine
    from pagoda.entrypoints.engine_args import engine_kwargs
    from pagoda.entrypoints.server.app import create_app
    from pagoda.entrypoints.server.metrics import ServerMetrics
    from pagoda.executor.multiproc import launched_by_torchrun, run_torchrun_worker

    logging.getLogger("pagoda").setLevel(args.log_level.upper())
    paths = list(dict.fromkeys([*([args.model] if args.model is not None else []), *(args.model_flag or [])]))
    args.model = paths[0] if paths else None
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise ValueError("--max-waiting-requests must be at least 1")
    if args.max_request_body_bytes < 1:
        raise ValueError("--max-request-body-bytes must be at least 1")
    if not 0 <= args.drain_timeout < float("inf"):
        raise ValueError("--drain-timeout must be a non-negative number of seconds")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    if not 0 < args.step_timeout < float("inf"):
        raise ValueError("--step-timeout must be a positive number of seconds")
    if not 0 < args.header_timeout < float("inf"):
        raise ValueError("--header-timeout must be a positive number of seconds")
    if args.structured_outputs_compile_workers < 1:
        raise ValueError("--structured-outputs-compile-workers must be at least 1: a server never compiles a "
                         "client's grammar in its own process")
    settings_kwargs = dict(api_key=server_api_key(args.api_key), max_waiting_requests=args.max_waiting_requests,
                           drain_timeout=args.drain_timeout, max_request_body_bytes=args.max_request_body_bytes)
    if len(paths) > 1 or args.models_dir is not None:
        from pagoda.entrypoints.server import multi_model

        return multi_model.main(args, paths, server_settings(args, [], []))
    if args.task != "generate":
        from pagoda.entrypoints.server.pooling_app import serve_pooling

        return serve_pooling(args, settings_kwargs)
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))  # bad flags fail before loading
    if config.tensor_parallel_size > 1 and launched_by_torchrun() and int(os.environ["RANK"]) > 0:
        run_torchrun_worker(config)  # torchrun started every rank with this command: this one serves rank 0
        return 0
    names, aliases = served_names(args.model, args.served_model_name)
    if args.data_parallel_size != 1:
        from pagoda.entrypoints.server import data_parallel

        return data_parallel.main(args, names[0])
    metrics = ServerMetrics(names[0])
    async_engine = AsyncEngine.launch(lambda: LLMEngine(config), metrics)
    engine = async_engine.engine
    metrics.set_cache_config(config.cache.block_size, config.cache.kv_cache_dtype, config.cache.enable_prefix_caching,
                             engine.kv.pool.num_blocks)
    settings = server_settings(args, names, aliases)
    pooling = None
    if args.embedding_model is not None:
        from pagoda.entrypoints.server.pooling_app import build_pooling
        from pagoda.model.default_model import DEFAULT_EMBEDDING_NAME

        path = None if args.embedding_model == "default" else args.embedding_model
        pool_names, pool_aliases = served_names(path, None)
        pooling = build_pooling(path, {k: v for k, v in engine_kwargs(args).items() if k in ("dtype", "threads")}
                                | {"max_queue_delay_ms": args.max_queue_delay_ms},
                                [DEFAULT_EMBEDDING_NAME] if path is None else pool_names, pool_aliases,
                                metrics.registry)
    app = create_app(async_engine, settings, metrics, pooling)

    def begin_shutdown(timeout: float) -> None:
        async_engine.begin_shutdown(timeout)
        engine.structured.close()  # a compile under way is killed, its request answered 503

    return run_server(app, args, begin_shutdown, names[0])
