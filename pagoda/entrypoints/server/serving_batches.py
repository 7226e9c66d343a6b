"""OpenAI's /v1/files and /v1/batches: upload a JSONL of requests, run it as a job at the lowest priority
(batch_runner.py), download its output and error files. Files and jobs are kept on disk (batch_store.py) in
`--batch-dir`, opened at the first use (or at start, where a previous run left jobs to resume)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from pagoda.entrypoints.server.batch_runner import ENDPOINTS, MAX_LINES, BatchRunner, Send
from pagoda.entrypoints.server.batch_store import Batch, BatchStore, FileObject, new_id
from pagoda.entrypoints.server.errors import APIError

PURPOSES = ("batch",)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def in_process_client(app: FastAPI, api_key: str | None) -> tuple[httpx.AsyncClient, Send]:
    """A client of `app` itself (no socket): what a batch line is sent through, with the server's key."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagoda.batch",
                               timeout=None, headers={"authorization": f"Bearer {api_key}"} if api_key else None)

    async def send(url: str, body: dict[str, Any]) -> tuple[int, Any]:
        r = await client.post(url, json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text, "type": "server_error"}}

    return client, send


def _page(items: list[Any], after: str | None, limit: int) -> dict[str, Any]:
    if not 1 <= limit <= 10_000:
        raise APIError(400, "limit must be between 1 and 10000", "limit")
    ids = [i.id for i in items]
    start = ids.index(after) + 1 if after in ids else 0
    page = items[start:start + limit]
    return {"object": "list", "data": [i.to_dict() for i in page], "has_more": start + limit < len(items),
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


class BatchesServing:
    def __init__(self, root: Path, send: Send, concurrency: int) -> None:
        self.root, self.send, self.concurrency = root, send, concurrency
        self._runner: BatchRunner | None = None

    @property
    def runner(self) -> BatchRunner:
        if self._runner is None:
            try:
                store = BatchStore(self.root)
            except (OSError, RuntimeError) as e:
                raise APIError(503, f"batch storage unavailable: {e}") from e
            self._runner = BatchRunner(store, self.send, self.concurrency)
        return self._runner

    def resume(self) -> None:
        """At start: jobs a previous run left unfinished go on (the folder is opened only if it exists)."""
        if (self.root / "batches").is_dir():
            self.runner.resume()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
            self._runner.store.close()

    # ---- files ----------------------------------------------------------------------------------------
    def upload(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise APIError(400, f"the file is not UTF-8 text: {e}", "file") from e
        lines = sum(1 for ln in text.splitlines() if ln.strip())
        if not 0 < lines <= MAX_LINES:
            raise APIError(400, f"a batch file holds 1 to {MAX_LINES} JSON lines, this one {lines}", "file")
        return self.runner.store.files.create(data, filename, purpose).to_dict()

    def files(self, purpose: str | None, after: str | None, limit: int) -> dict[str, Any]:
        return _page(self.runner.store.files.list(purpose), after, limit)

    def file(self, file_id: str) -> dict[str, Any]:
        return self.runner.store.files.get(file_id).to_dict()

    def content(self, file_id: str) -> Path:
        self.runner.store.files.get(file_id)
        return self.runner.store.files.path(file_id)

    def delete_file(self, file_id: str) -> dict[str, Any]:
        files = self.runner.store.files
        files.get(file_id)
        if any(b.status not in ("completed", "failed", "cancelled") and file_id in
               (b.input_file_id, b.output_file_id, b.error_file_id) for b in self.runner.store.list()):
            raise APIError(400, f"file {file_id} belongs to a batch that is still running", "file_id")
        files.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches --------------------------------------------------------------------------------------
    def create(self, req: CreateBatchRequest) -> dict[str, Any]:
        if req.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {req.endpoint!r}", "endpoint")
        if req.completion_window != "24h":
            raise APIError(400, "completion_window must be 24h", "completion_window")
        store = self.runner.store
        source: FileObject = store.files.get(req.input_file_id)
        if source.purpose != "batch":
            raise APIError(400, f"file {source.id} was not uploaded with purpose batch", "input_file_id")
        job = new_id("batch")
        output = store.files.create(b"", f"{job}_output.jsonl", "batch_output")
        errors = store.files.create(b"", f"{job}_error.jsonl", "batch_output")
        batch = Batch(job, req.endpoint, source.id, output.id, errors.id, req.completion_window,
                      metadata=req.metadata)
        store.save(batch)
        self.runner.start(batch)
        return batch.to_dict()

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.runner.get(batch_id).to_dict()

    def batches(self, after: str | None, limit: int) -> dict[str, Any]:
        return _page([self.runner.get(b.id) for b in self.runner.store.list()], after, limit)

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        return (await self.runner.cancel(batch_id)).to_dict()
