"""Files and batch jobs on disk, in the shapes of OpenAI's /v1/files and /v1/batches.

Everything lives under one folder (`--batch-dir`), locked by one server at a time:
  files/<file-id>          a file's bytes (an upload, or a job's output or error file as it grows)
  files/<file-id>.json     its record: id, bytes, created_at, filename, purpose
  batches/<batch-id>.json  a job's record, replaced atomically on every change of state
A job's progress is its output and error files themselves (batch_runner.py): a result line is appended and
synced before the line counts as done, so a server killed at any moment resumes without losing or repeating one.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagoda.entrypoints.server.errors import APIError

_ID = re.compile(r"(file|batch)-[0-9a-f]{32}")


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def _checked(kind: str, object_id: str) -> str:
    """An id as this store writes it; anything else (a path, `..`) is a 404 before the filesystem is touched."""
    if not _ID.fullmatch(object_id) or not object_id.startswith(kind + "-"):
        raise APIError(404, f"no {kind} with id {object_id!r}", f"{kind}_id")
    return object_id


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def to_dict(self) -> dict[str, Any]:
        return {"object": "file", **asdict(self), "status": "processed"}


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root / "files"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / _checked("file", file_id)

    def create(self, data: bytes, filename: str, purpose: str) -> FileObject:
        obj = FileObject(new_id("file"), len(data), int(time.time()), filename, purpose)
        write_atomically(self.path(obj.id), data)
        self._save(obj)
        return obj

    def get(self, file_id: str) -> FileObject:
        meta = self.path(file_id).with_suffix(".json")
        if not meta.exists():
            raise APIError(404, f"no file with id {file_id!r}", "file_id")
        obj = FileObject(**json.loads(meta.read_text()))
        obj.bytes = self.path(file_id).stat().st_size  # a job's output grows after its record was written
        return obj

    def list(self, purpose: str | None = None) -> list[FileObject]:
        objs = [self.get(p.stem) for p in self.root.glob("file-*.json")]
        return sorted((o for o in objs if purpose is None or o.purpose == purpose), key=lambda o: o.created_at)

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self.path(file_id).with_suffix(".json").unlink()
        self.path(file_id).unlink(missing_ok=True)

    def _save(self, obj: FileObject) -> None:
        write_atomically(self.path(obj.id).with_suffix(".json"), json.dumps(asdict(obj)).encode())


# A job's states, as OpenAI names them; a job in one of ACTIVE is resumed when the server starts.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    output_file_id: str
    error_file_id: str
    completion_window: str = "24h"
    status: str = "validating"
    created_at: int = field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    metadata: dict[str, str] | None = None
    errors: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"object": "batch", **asdict(self), "expires_at": None, "expired_at": None}

    def mark(self, status: str) -> None:
        self.status = status
        setattr(self, f"{status}_at", int(time.time()))


class BatchStore:
    """Job records, and the lock that keeps a second server off the same folder."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / "lock", "a")  # held for this process's life
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"{root} is in use by another server: give this one its own --batch-dir") from None
        self.root = root / "batches"
        self.root.mkdir(exist_ok=True)
        self.files = FileStore(root)

    def save(self, batch: Batch) -> None:
        write_atomically(self.root / f"{batch.id}.json", json.dumps(asdict(batch)).encode())

    def get(self, batch_id: str) -> Batch:
        path = self.root / f"{_checked('batch', batch_id)}.json"
        if not path.exists():
            raise APIError(404, f"no batch with id {batch_id!r}", "batch_id")
        return Batch(**json.loads(path.read_text()))

    def list(self) -> list[Batch]:
        batches = [self.get(p.stem) for p in self.root.glob("batch-*.json")]
        return sorted(batches, key=lambda b: b.created_at, reverse=True)

    def close(self) -> None:
        self._lock.close()
