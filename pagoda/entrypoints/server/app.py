"""The FastAPI app: OpenAI's /v1 routes over one AsyncEngine (serving_completions.py, serving_chat.py), plus
health, tokenizer and metrics routes, and the routes a router in front of several servers asks (vllm-router:
/get_load, /flush_cache, /get_server_info, /get_model_info, /health_generate; docs/deployment.md); errors in
OpenAI's shape (errors.py) and the ASGI middlewares (middleware.py)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Form, Request, UploadFile
from fastapi.responses import FileResponse, Response

import pagoda
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError, bad_request, error_response, install_error_handlers
from pagoda.entrypoints.server.metrics import CONTENT_TYPE, ServerMetrics
from pagoda.entrypoints.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from pagoda.entrypoints.server.openapi import install_openapi
from pagoda.entrypoints.server.serving import Serving
from pagoda.entrypoints.server.serving_batches import BatchesServing, CreateBatchRequest, in_process_client
from pagoda.entrypoints.server.serving_chat import ChatServing
from pagoda.entrypoints.server.serving_completions import create_completion, render_completion
from pagoda.entrypoints.server.serving_lora import lora_router
from pagoda.entrypoints.server.serving_messages import CountTokensRequest, MessagesRequest, MessagesServing
from pagoda.entrypoints.server.serving_pooling import PoolingServing, pooling_router
from pagoda.entrypoints.server.serving_responses import ResponsesRequest, ResponsesServing
from pagoda.entrypoints.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings
from pagoda.sampling_params import SamplingParams

__all__ = ["DEFAULT_MAX_REQUEST_BODY_BYTES", "ServerSettings", "create_app", "server_info"]

logger = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT_S = 30.0


def server_info(core: Any, settings: ServerSettings) -> dict[str, Any]:
    """The engine's configuration in the layout of vLLM's `/server_info?config_format=json` (a `vllm_config`
    with `model_config`, `cache_config`, ...), which routers read for the model and the KV block size."""
    cfg = core.config
    return {
        "version": pagoda.__version__,
        "vllm_config": {
            "model_config": {"model": settings.model_root or settings.served_model_names[0],
                             "served_model_name": settings.served_model_names[0],
                             "max_model_len": core.max_model_len, "dtype": str(core.dtype).removeprefix("torch."),
                             "quantization": cfg.quantization},
            "cache_config": {"block_size": cfg.cache.block_size, "cache_dtype": cfg.cache.kv_cache_dtype,
                             "enable_prefix_caching": cfg.cache.enable_prefix_caching,
                             "num_gpu_blocks": core.kv.pool.num_blocks},
            "scheduler_config": {"max_num_seqs": cfg.scheduler.max_num_seqs,
                                 "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens},
            "parallel_config": {"tensor_parallel_size": cfg.tensor_parallel_size,
                                "data_parallel_size": 1},
        },
    }


def create_app(engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None,
               pooling: PoolingServing | None = None) -> FastAPI:
    """The app over `engine`; with `pooling`, the pooling routes too (serving_pooling.py: an embedding or
    rerank model beside the chat model)."""
    s = Serving(engine, settings)
    chat = ChatServing(s, settings.tool_call_parser)
    messages = MessagesServing(chat)
    responses = ResponsesServing(chat)
    inputs, tokenizer, names = s.inputs, s.tokenizer, s.names
    core = engine.engine  # for what the engine reports about itself (/version, /server_info)

    batches: BatchesServing | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if batches is not None:
            batches.resume()
        yield
        if batches is not None:  # jobs stop where they are; the next start resumes them
            await batches.stop()
            await batch_client.aclose()
        # uvicorn has stopped accepting and waited for connections; finish or abort what is left.
        await engine.shutdown(settings.drain_timeout)

    app = FastAPI(title="pagoda", version=pagoda.__version__, lifespan=lifespan)
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes,
                       uploads=(("/v1/files",), settings.max_upload_bytes))
    if settings.api_key:  # added last, so outermost: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.state.engine = engine
    app.state.metrics = metrics

    install_error_handlers(app)

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions", response_model=None)
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        return await create_completion(s, req, request)

    @v1.post("/chat/completions", response_model=None)
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Any:
        return await chat.create(req, request)

    @v1.post("/responses", response_model=None)
    async def create_response(req: ResponsesRequest, request: Request) -> Any:
        return await responses.create(req, request)

    @v1.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses.get(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses.delete(response_id)

    @v1.post("/messages", response_model=None)
    async def create_message(req: MessagesRequest, request: Request) -> Any:
        return await messages.create(req, request)

    @v1.post("/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest) -> dict[str, int]:
        return await messages.count_tokens(req)

    # ---- files and batch jobs (serving_batches.py) ----------------------------------------------------
    if settings.batch_dir is not None:
        batch_client, send = in_process_client(app, settings.api_key)
        batches = BatchesServing(settings.batch_dir, send, core.config.scheduler.max_num_seqs)

    def batch_jobs() -> BatchesServing:
        if batches is None:
            raise APIError(404, "files and batches are off on this server (start it with --batch-dir)")
        return batches

    @v1.post("/files")
    async def upload_file(file: UploadFile, purpose: str = Form(...)) -> dict[str, Any]:
        data = await file.read()
        return await asyncio.to_thread(batch_jobs().upload, data, file.filename or "upload.jsonl", purpose)

    @v1.get("/files")
    async def list_files(purpose: str | None = None, after: str | None = None, limit: int = 10_000) -> dict[str, Any]:
        return batch_jobs().files(purpose, after, limit)

    @v1.get("/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        return batch_jobs().file(file_id)

    @v1.get("/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        return FileResponse(batch_jobs().content(file_id), media_type="application/jsonl")

    @v1.delete("/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        return batch_jobs().delete_file(file_id)

    @v1.post("/batches")
    async def create_batch(req: CreateBatchRequest) -> dict[str, Any]:
        return batch_jobs().create(req)

    @v1.get("/batches")
    async def list_batches(after: str | None = None, limit: int = 20) -> dict[str, Any]:
        return batch_jobs().batches(after, limit)

    @v1.get("/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict[str, Any]:
        return batch_jobs().batch(batch_id)

    @v1.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return await batch_jobs().cancel(batch_id)

    # vLLM's render routes: the prompt's token ids, nothing generated (vllm-router's cache_aware asks for them)
    @v1.post("/completions/render")
    async def completions_render(req: P.CompletionRequest) -> list[dict[str, Any]]:
        return await render_completion(s, req)

    @v1.post("/chat/completions/render")
    async def chat_completions_render(req: P.ChatCompletionRequest) -> dict[str, Any]:
        return await chat.render(req)

    @v1.get("/models")
    async def models() -> P.ModelList:
        cards = [P.ModelCard(id=name, root=settings.model_root or name, max_model_len=inputs.max_model_len)
                 for name in names] + s.loras.cards(inputs.max_model_len)
        if pooling is not None:  # the embedding model served beside the chat model
            cards += [P.ModelCard(id=name, root=pooling.runner.folder, max_model_len=pooling.runner.max_model_len)
                      for name in pooling.names]
        return P.ModelList(data=cards)

    app.include_router(v1)
    app.include_router(lora_router(s.loras))
    if pooling is not None:
        app.include_router(pooling_router(pooling))

    # ---- unauthenticated operational routes ----------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "engine is not running")
        stalled = engine.step_seconds
        if stalled > settings.step_timeout:  # the step watchdog: a stopped rank or a wedged kernel
            logger.warning("health: the engine step has run %.0f s (--step-timeout %g s)", stalled,
                           settings.step_timeout)
            return error_response(503, f"the engine has made no progress for {stalled:.0f} s (--step-timeout)")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        policy = core.runner.policy
        return {"version": pagoda.__version__, "cpu_kernels": policy.kernel_set,
                "cpu_kernels_build": policy.kernel_build}

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> P.TokenizeResponse:
        s.check_model(req.model)
        if req.messages is not None:
            try:
                conv = P.ChatCompletionRequest(messages=req.messages).conversation()
            except ValueError as e:
                raise bad_request(e) from e
            ids = await s.chat_prompt(conv, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await s.off_loop(inputs.tokenize, req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return P.TokenizeResponse(count=len(ids), max_model_len=inputs.max_model_len, tokens=list(ids))

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        s.check_model(req.model)
        vocab = inputs.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "tokens")
        return P.DetokenizeResponse(prompt=await s.off_loop(tokenizer.decode, req.tokens, param="tokens"))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    # ---- what a router in front of several servers asks (vllm-router; docs/deployment.md) --------------
    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's name: requests in flight (queued, waiting or running)."""
        return {"server_load": engine.num_in_flight}

    @app.get("/get_load")
    async def get_load() -> dict[str, int]:
        """The load vllm-router's power_of_two policy polls (and its /get_loads lists)."""
        return {"load": engine.num_in_flight}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(core, settings)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        root = settings.model_root or names[0]
        return {"model_path": root, "tokenizer_path": root, "is_generation": True}

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        """The name vllm-router's POST /flush_cache fans out to every worker: forget the prefix cache."""
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if the engine generates: one greedy token of a one-token prompt."""
        if not engine.is_running:
            return error_response(503, "engine is not running")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        bos = getattr(tokenizer, "bos_token_id", None)
        prompt = [bos if bos is not None else 0]

        async def one_token() -> bool:
            async for out in engine.generate(prompt, params):
                if out.finished:
                    return bool(out.outputs and out.outputs[0].token_ids)
            return False

        try:
            ok = await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure to generate is unhealthy
            logger.warning("health_generate failed: %s", e)
            ok = False
        return Response(status_code=200) if ok else error_response(503, "engine did not generate")

    return app
