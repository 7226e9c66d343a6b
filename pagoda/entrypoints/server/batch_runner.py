"""Batch jobs run through the server's own routes, at the lowest priority.

Each input line ({"custom_id", "method": "POST", "url", "body"}) is sent to the route it names as a request
of this app (in process, through httpx's ASGI transport), so it passes the same validation, limits and error
shapes as a client's. Its body is sent with `priority` the lowest there is, so interactive requests go first
under the priority policy, and with the job as its `user` where it names none, so a job shares one client's
seats (core/fairness.py) rather than taking one per line.

Progress is the result files. A result line names its input line (`batch_req_<job>_<line>`) and is appended
and synced before the line counts as done; a job resumed after a crash reads which lines its files hold (a
torn last line is cut off first) and runs only the others, so no line is lost or answered twice. A line that
is not a request (bad JSON, no custom_id, a repeated custom_id, another method or url) or that its route
refuses goes to the error file; the output file holds the answered ones.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from pagoda.entrypoints.server.batch_store import ACTIVE, Batch, BatchStore

logger = logging.getLogger(__name__)

BATCH_PRIORITY = 2**31 - 1  # the lowest priority a request can have (protocol.Priority)
MAX_LINES = 50_000          # as OpenAI's limit per job
# POSTs a line may name: the generation routes (stream forced off), and embeddings where the server has them.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/embeddings")

# Sends one line's body to its route: (HTTP status, the JSON answer).
Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]


def request_id(job: str, line: int) -> str:
    return f"batch_req_{job.removeprefix('batch-')}_{line}"


def line_of(result: dict[str, Any]) -> int | None:
    rid = result.get("id")
    return int(rid.rsplit("_", 1)[1]) if isinstance(rid, str) and rid.startswith("batch_req_") else None


def parse_line(text: str, endpoints: tuple[str, ...], seen: set[str]) -> tuple[str | None, tuple[str, dict] | str]:
    """(custom_id, (url, body to send)) of an input line, or (custom_id or None, why it is not a request)."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"line is not JSON: {e}"
    if not isinstance(item, dict):
        return None, "line is not a JSON object"
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, "custom_id must be a non-empty string"
    if cid in seen:
        return cid, f"custom_id {cid!r} is repeated"
    seen.add(cid)
    if item.get("method", "POST") != "POST":
        return cid, "method must be POST"
    if item.get("url") not in endpoints:
        return cid, f"url must be {' or '.join(endpoints)}, got {item.get('url')!r}"
    if not isinstance(item.get("body"), dict):
        return cid, "body must be a JSON object"
    return cid, (item["url"], item["body"])


def read_results(path: Path) -> list[dict[str, Any]]:
    """The complete result lines of a file; a torn last line (a write cut off by a crash) is truncated away."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def _append(f: TextIO, result: dict[str, Any]) -> None:
    f.write(json.dumps(result, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


async def run_lines(job: str, lines: list[str], endpoints: tuple[str, ...], done: set[int], send: Send,
                    concurrency: int, write: Callable[[dict[str, Any], bool], None]) -> None:
    """Answer every line not in `done`, at most `concurrency` at once; `write(result, ok)` records each."""
    seen: set[str] = set()
    parsed = [parse_line(text, endpoints, seen) for text in lines]
    slots = asyncio.Semaphore(concurrency)

    async def one(index: int, cid: str | None, request: tuple[str, dict[str, Any]] | str) -> None:
        rid = request_id(job, index)
        if isinstance(request, str):
            write({"id": rid, "custom_id": cid, "response": None,
                   "error": {"code": "invalid_request", "message": request, "line": index + 1}}, False)
            return
        url, body = request
        body = {**body, "stream": False, "priority": BATCH_PRIORITY}
        body.setdefault("user", job)
        async with slots:
            status, answer = await send(url, body)
        write({"id": rid, "custom_id": cid, "response": {"status_code": status, "request_id": rid, "body": answer},
               "error": None}, status == 200)

    tasks = [asyncio.create_task(one(i, cid, request)) for i, (cid, request) in enumerate(parsed) if i not in done]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # cancelled (a cancelled job, a server stopping): nothing more is written
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BatchRunner:
    """Runs and resumes the jobs of one BatchStore; one asyncio task per running job."""

    def __init__(self, store: BatchStore, send: Send, concurrency: int) -> None:
        self.store, self.send, self.concurrency = store, send, concurrency
        self._running: dict[str, tuple[asyncio.Task, Batch]] = {}  # the task's own record: it alone saves it

    def resume(self) -> None:
        """Start every job a previous run of the server left unfinished."""
        for batch in self.store.list():
            if batch.status in ACTIVE:
                logger.info("resuming batch %s (%s)", batch.id, batch.status)
                self.start(batch)

    def start(self, batch: Batch) -> None:
        task = asyncio.create_task(self._run(batch))
        self._running[batch.id] = (task, batch)
        task.add_done_callback(lambda _: self._running.pop(batch.id, None))

    def get(self, batch_id: str) -> Batch:
        running = self._running.get(batch_id)
        return running[1] if running is not None else self.store.get(batch_id)

    async def cancel(self, batch_id: str) -> Batch:
        batch = self.get(batch_id)
        if batch.status not in ("validating", "in_progress"):
            return batch
        task = self._running[batch_id][0] if batch_id in self._running else None
        batch.mark("cancelling")
        self.store.save(batch)  # a crash from here on still ends as cancelled (resume sees "cancelling")
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return self._finish(batch, "cancelled")

    async def stop(self) -> None:
        """The server is stopping: jobs stop where they are, to be resumed at its next start."""
        tasks = [task for task, _ in self._running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, batch: Batch) -> None:
        files = self.store.files
        try:
            lines = [ln for ln in files.path(batch.input_file_id).read_text().splitlines() if ln.strip()]
            if batch.status == "cancelling":
                self._finish(batch, "cancelled")
                return
            out_path, err_path = files.path(batch.output_file_id), files.path(batch.error_file_id)
            answered, failed = read_results(out_path), read_results(err_path)
            done = {i for i in map(line_of, [*answered, *failed]) if i is not None}
            batch.request_counts = {"total": len(lines), "completed": len(answered), "failed": len(failed)}
            batch.mark("in_progress")
            self.store.save(batch)
            with open(out_path, "a", encoding="utf-8") as out, open(err_path, "a", encoding="utf-8") as err:
                def write(result: dict[str, Any], ok: bool) -> None:
                    # The counts live here while the job runs (`get` reads this record) and a resume recounts
                    # them from the result files: the record on disk changes only with the status.
                    _append(out if ok else err, result)
                    batch.request_counts["completed" if ok else "failed"] += 1

                # A refused line (a 4xx from its route) is an error line too: `ok` is the status 200.
                await run_lines(batch.id, lines, (batch.endpoint,), done, self.send, self.concurrency, write)
            batch.mark("finalizing")
            self._finish(batch, "completed")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an unreadable input file, a full disk: the job fails, the server goes on
            logger.exception("batch %s failed", batch.id)
            batch.errors = {"object": "list", "data": [{"code": "batch_failed", "message": str(e)}]}
            self._finish(batch, "failed")

    def _finish(self, batch: Batch, status: str) -> Batch:
        batch.mark(status)
        self.store.save(batch)
        return batch
