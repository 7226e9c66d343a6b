"""`pagoda serve [MODEL]`: load the engine, then run the OpenAI-compatible app under uvicorn; with
--data-parallel-size N, N such servers behind vllm-router instead (data_parallel.py); with several models
(--model twice, --models-dir), one server for all of them (multi_model.py)."""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from pagoda.entrypoints.server.data_parallel import ROUTER_POLICIES
from pagoda.entrypoints.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_UPLOAD_BYTES, ServerSettings
from pagoda.tools.formats import FORMATS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pagoda.entrypoints.cli import add_engine_args

    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", action="append", default=None, metavar="MODEL",
                   help="the same as the positional MODEL; given more than once, one server serves every model, "
                        "each request going to the one its `model` field names (docs/deployment.md)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but the probes (default: "
                        "$PAGODA_API_KEY); with --data-parallel-size, the front checks it and no child sees it")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first one is reported (default: the model's base name; "
                        "the path is accepted too)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="answer 503 + Retry-After when more requests than this wait for the engine")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="answer 413 to a request body larger than this")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds to let in-flight requests finish before aborting them")
    p.add_argument("--structured-outputs-compile-timeout", type=float, default=30.0,
                   help="seconds a request's grammar (response_format, structured_outputs, tools) may compile "
                        "before its worker is killed and that request gets a 400")
    p.add_argument("--structured-outputs-compile-memory", default="2GiB",
                   help="memory a request's grammar compile may add to its worker before it is killed (a 400)")
    p.add_argument("--structured-outputs-compile-workers", type=int, default=2,
                   help="processes that compile grammars (started as needed; each killable on its own)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(FORMATS),
                   help="the models' tool-call syntax (default: read from the chat template, else hermes)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most; more are closed at once (default: the open-file limit, "
                        "raised to its maximum, less 256)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers before it is closed")
    p.add_argument("--step-timeout", type=float, default=60.0,
                   help="seconds one engine step may run before /health answers 503 (a stopped tensor-parallel "
                        "rank, a wedged kernel)")
    pool = p.add_argument_group("pooling: embeddings, score and rerank (serving_pooling.py)")
    pool.add_argument("--task", default="generate", choices=["generate", "embed", "score"],
                      help="generate: a chat model; embed / score: only a pooling model (an encoder, a "
                           "cross-encoder for score, or a causal LM pooled at its last token), default the "
                           "embedded all-MiniLM-L6-v2")
    pool.add_argument("--classifier-from-token", default=None, metavar="NO,YES",
                      type=lambda v: [t for t in v.split(",") if t],
                      help="with --task score and a causal LM: score a pair by the softmax over these tokens' "
                           "logits at its last position, the last one's probability (Qwen3-Reranker: no,yes)")
    pool.add_argument("--embedding-model", default=None, metavar="PATH",
                      help="with --task generate, also serve this pooling model's routes (/v1/embeddings, /score, "
                           "/rerank, /embed) beside the chat model ('default': the embedded all-MiniLM-L6-v2)")
    pool.add_argument("--max-queue-delay-ms", type=float, default=None,
                      help="ms a pooling request waits for others to share its forward (default 2)")
    p.add_argument("--batch-dir", default=None,
                   help="folder of /v1/files and /v1/batches (uploads, job records, outputs; a job left running "
                        "resumes at the next start); `none` turns those routes off (default: "
                        "$XDG_STATE_HOME/pagoda/batches/PORT, made at the first upload)")
    p.add_argument("--max-upload-bytes", type=int, default=DEFAULT_MAX_UPLOAD_BYTES,
                   help="answer 413 to a /v1/files upload larger than this (it is read into memory)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served from the start, each chosen by its NAME in a "
                        "request's `model` field (needs --enable-lora)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    mm = p.add_argument_group("several models in one server (multi_model.py, docs/deployment.md)")
    mm.add_argument("--models-dir", default=None, metavar="DIR",
                    help="also serve every model in DIR (a folder with config.json, or a .gguf file), named by its "
                         "folder's or file's base name")
    mm.add_argument("--preload", action="store_true",
                    help="load every model at start (default: each at its first request)")
    mm.add_argument("--models-memory", default=None, metavar="BYTES",
                    help="memory the loaded models may take together, in bytes or e.g. 8GiB: a load first unloads "
                         "the least recently used idle models (default: no limit)")
    mm.add_argument("--models-idle-unload", type=float, default=None, metavar="SECONDS",
                    help="unload a model nobody has sent a request for this long (default: never)")
    dp = p.add_argument_group("data parallelism: replicas on this host behind vllm-router (docs/deployment.md)")
    dp.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="engine replicas, each a server on its own cores and loopback port, behind vllm-router "
                         "(keyed, on loopback) and Pagoda's front on --host/--port")
    dp.add_argument("--data-parallel-base-port", type=int, default=None,
                    help="the replicas' ports on 127.0.0.1: BASE, BASE+1, ... (default: --port + 1; 0 = any free)")
    dp.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                    help="vllm-router's policy: cache_aware sends requests that share a prefix to the same replica")
    dp.add_argument("--router-args", default="",
                    help="more vllm-router flags, as one string (e.g. '--cache-threshold 0.5')")
    add_engine_args(p)


def served_names(model: str | None, given: list[str] | None) -> tuple[list[str], list[str]]:
    """(names listed by /v1/models, other names requests may use). Without --served-model-name a model is
    served as its folder's or file's base name (a GGUF without `.gguf`), and the path as given is accepted."""
    if given:
        return list(given), []
    if model is None:
        return [DEFAULT_MODEL_NAME], []
    base = Path(model.rstrip("/")).name
    name = base[:-len(".gguf")] if base.endswith(".gguf") and len(base) > len(".gguf") else base
    aliases = [a for a in dict.fromkeys((model, model.rstrip("/"), base)) if a != name]
    return [name], aliases


def batch_dir(given: str | None, port: int) -> Path | None:
    """--batch-dir as given (`none`: off), else a folder per port in the user's state folder."""
    if given is not None:
        return None if given.lower() == "none" else Path(given)
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "pagoda" / "batches" / str(port)


def main(args: argparse.Namespace) -> int:
    from pagoda.config import EngineConfig, server_api_key
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.engine.engine import LLMEngine
    from pagoda.entrypoints.cli import engine_kwargs
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
    engine = LLMEngine(config)
    metrics = ServerMetrics(names[0])
    metrics.set_cache_config(config.cache.block_size, config.cache.kv_cache_dtype, config.cache.enable_prefix_caching,
                             engine.kv.pool.num_blocks)
    settings = server_settings(args, names, aliases)
    async_engine = AsyncEngine(engine, metrics)
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


def server_settings(args: argparse.Namespace, names: list[str], aliases: list[str]) -> ServerSettings:
    """The server's settings from its flags; `names` and `aliases` are the model's (served_names)."""
    from pagoda.config import server_api_key
    from pagoda.entrypoints.server.serving_lora import parse_lora_modules

    return ServerSettings(
        served_model_names=names,
        model_aliases=aliases,
        api_key=server_api_key(args.api_key),
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout=args.drain_timeout,
        model_root=args.model or DEFAULT_MODEL_NAME,
        max_request_body_bytes=args.max_request_body_bytes,
        tool_call_parser=args.tool_call_parser,
        step_timeout=args.step_timeout,
        batch_dir=batch_dir(args.batch_dir, args.port),
        max_upload_bytes=args.max_upload_bytes,
        lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
    )


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
