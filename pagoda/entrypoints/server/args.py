"""The flags of `pagoda serve` and what they mean: the server's own (this file) and the engine's
(entrypoints/engine_args.py), the model's served names, and the ServerSettings the flags make. Read by the
server (cli.py), by the data-parallel launcher to forward them to its replicas, and by the multi-model and
pooling servers."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from pagoda.entrypoints.engine_args import add_engine_args
from pagoda.entrypoints.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_UPLOAD_BYTES, ServerSettings
from pagoda.tools.formats import FORMATS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# vllm-router's policies that Pagoda's server serves everything for (docs/deployment.md has what each asks);
# kv_aware needs vLLM's ZMQ KV-cache events, which Pagoda does not publish.
ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin", "random", "consistent_hash", "sticky_least_loaded")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `pagoda serve`, the engine's included."""
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
