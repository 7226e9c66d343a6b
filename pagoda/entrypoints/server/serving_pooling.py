"""The pooling routes, in the shapes clients already send: OpenAI's /v1/embeddings, vLLM's /score, the
Jina/Cohere rerank (/rerank, /v1/rerank, /v2/rerank) and text-embeddings-inference's /embed and /rerank (told
apart from Jina's by its `texts` field). Every request's sequences go to the dynamic batcher
(engine/pooling_batcher.py); tokenizing runs off the event loop."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import torch
from fastapi import APIRouter
from pydantic import BaseModel, Field

from pagoda.engine.pooling_batcher import PoolingBatcher
from pagoda.engine.scoring import ScoreJob, pair_up
from pagoda.entrypoints.pooling import check_dimensions
from pagoda.entrypoints.server.errors import APIError
from pagoda.executor.pooling_runner import PoolingInput
from pagoda.layers.pooler import truncate_and_normalize

# OpenAI's limit on inputs in one embeddings request; also bounds documents in one rerank or score.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: cut inputs to this many tokens (-1: the model's limit)


class ScoreRequest(BaseModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(BaseModel):
    """Jina's and Cohere's shape (`documents`), or TEI's (`texts`, `return_text`, `raw_scores`)."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]] | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    texts: list[str] | None = None
    return_text: bool = False
    truncate: bool = False


class TEIEmbedRequest(BaseModel):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    dimensions: int | None = None


# The response bodies, for the OpenAPI document (openapi.py); the handlers build them as dicts, so a large
# batch of vectors is not validated field by field on its way out.
class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """Jina's and Cohere's answer; a TEI request (`texts`) gets a list of TEIRerankResult."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class TEIRerankResult(BaseModel):
    index: int
    score: float
    text: str | None = None


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def _check_count(n: int, param: str) -> None:
    if n == 0:
        raise APIError(400, f"{param} must not be empty", param)
    if n > MAX_INPUTS:
        raise APIError(400, f"{param} has {n} entries; at most {MAX_INPUTS} in one request", param)


class PoolingServing:
    """The pooling model behind the routes: its batcher and the names it answers to."""

    def __init__(self, batcher: PoolingBatcher, names: list[str], aliases: list[str] | None = None,
                 metrics: Any = None) -> None:
        self.batcher = batcher
        self.runner = batcher.runner
        self.names = names
        self.accepted = set(names) | set(aliases or [])
        self.metrics = metrics

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.accepted:
            raise APIError(404, f"the model {model!r} does not exist; this server's pooling model is "
                           f"{self.names[0]!r}", "model")
        return self.names[0]

    async def _prepare(self, fn: Any, *args: Any, param: str) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), param) from e

    async def _pool(self, inputs: list[PoolingInput], endpoint: str) -> list[torch.Tensor]:
        if self.metrics is not None:
            self.metrics.on_pooling_request(endpoint)
        return await self.batcher.pool(inputs)

    def _need_embedder(self) -> None:
        if self.runner.is_cross_encoder:
            raise APIError(400, "this model is a cross-encoder: it scores text pairs (/score, /rerank), it does "
                           "not embed", "model")

    # ---- embeddings --------------------------------------------------------------------------------
    def _embedding_inputs(self, raw: Any, truncate: int | None) -> list[PoolingInput]:
        r = self.runner
        if isinstance(raw, str):
            raw = [raw]
        elif raw and isinstance(raw[0], int):
            raw = [raw]
        _check_count(len(raw), "input")
        out = []
        for item in raw:
            if isinstance(item, str):
                if not item:
                    raise ValueError("input must not contain an empty string")
                out.append(r.tokenize(item, truncate=truncate))
            else:
                out.append(r.from_token_ids(list(item), truncate))
        return out

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        self._need_embedder()
        try:
            check_dimensions(self.runner, req.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from e
        inputs = await self._prepare(self._embedding_inputs, req.input, req.truncate_prompt_tokens, param="input")
        vectors = await self._pool(inputs, "embeddings")
        if req.dimensions is not None:
            vectors = [truncate_and_normalize(v, req.dimensions, self.runner.pooler.normalize) for v in vectors]
        tokens = sum(len(x.token_ids) for x in inputs)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def tei_embed(self, req: TEIEmbedRequest) -> list[list[float]]:
        self._need_embedder()
        try:
            check_dimensions(self.runner, req.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from e
        inputs = await self._prepare(self._embedding_inputs, req.inputs, -1 if req.truncate else None,
                                     param="inputs")
        vectors = await self._pool(inputs, "embed")
        return [truncate_and_normalize(v, req.dimensions, req.normalize).tolist() for v in vectors]

    # ---- scores --------------------------------------------------------------------------------------
    async def _scores(self, text_1: str | list[str], text_2: str | list[str], truncate: int | None,
                      endpoint: str, param: str) -> tuple[list[float], ScoreJob]:
        pairs = await self._prepare(pair_up, text_1, text_2, param=param)
        _check_count(len(pairs), param)
        job = await self._prepare(ScoreJob.build, self.runner, pairs, truncate, param=param)
        return job.scores(await self._pool(job.inputs, endpoint)), job

    async def score(self, req: ScoreRequest) -> dict[str, Any]:
        model = self.check_model(req.model)
        scores, job = await self._scores(req.text_1, req.text_2, req.truncate_prompt_tokens, "score", "text_2")
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": job.num_tokens, "total_tokens": job.num_tokens}}

    async def rerank(self, req: RerankRequest) -> Any:
        model = self.check_model(req.model)
        if req.texts is not None:
            return await self._tei_rerank(req)
        if req.documents is None:
            raise APIError(400, "documents is required", "documents")
        docs = [d if isinstance(d, str) else d.get("text") for d in req.documents]
        if any(not isinstance(d, str) for d in docs):
            raise APIError(400, "documents must be strings or objects with a text field", "documents")
        _check_count(len(docs), "documents")
        scores, job = await self._scores(req.query, docs, req.truncate_prompt_tokens, "rerank", "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                "usage": {"total_tokens": job.num_tokens}}

    async def _tei_rerank(self, req: RerankRequest) -> list[dict[str, Any]]:
        texts = req.texts or []
        _check_count(len(texts), "texts")
        scores, _ = await self._scores(req.query, texts, -1 if req.truncate else None, "rerank", "texts")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        return [{"index": i, "score": scores[i], **({"text": texts[i]} if req.return_text else {})} for i in order]


def pooling_router(p: PoolingServing) -> APIRouter:
    """The pooling routes, for the pooling-only app (pooling_app.py) or beside a chat model (app.py)."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        return await p.embeddings(req)

    @router.post("/score")
    @router.post("/v1/score")
    async def score(req: ScoreRequest) -> dict[str, Any]:
        return await p.score(req)

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    async def rerank(req: RerankRequest) -> Any:
        return await p.rerank(req)

    @router.post("/embed")
    async def tei_embed(req: TEIEmbedRequest) -> list[list[float]]:
        return await p.tei_embed(req)

    return router


__all__ = ["EmbeddingRequest", "EmbeddingResponse", "PoolingServing", "RerankRequest", "RerankResponse",
           "ScoreRequest", "ScoreResponse", "TEIEmbedRequest", "TEIRerankResult", "pooling_router"]
