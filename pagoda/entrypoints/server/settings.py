"""The server's settings (`pagoda serve` flags beyond the engine's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
DEFAULT_MAX_UPLOAD_BYTES = 200 << 20  # one /v1/files upload, read whole into memory


@dataclass
class ServerSettings:
    served_model_names: list[str]  # listed by /v1/models; the first is reported
    model_aliases: list[str] = field(default_factory=list)  # also accepted as `model` (the path as given)
    api_key: str | None = None
    max_waiting_requests: int | None = None
    drain_timeout: float = 30.0
    model_root: str | None = None
    retry_after_s: int = 1
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    tool_call_parser: str | None = None  # None: the format the chat template writes
    step_timeout: float = 60.0  # seconds one engine step may run before /health answers 503
    batch_dir: Path | None = None  # /v1/files and /v1/batches keep their files here; None: those routes are off
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters served at start, name -> folder


@dataclass
class ModelsSettings:
    """Several models in one server (models.py): when they load and unload."""
    memory_budget: int | None = None  # bytes the loaded models may take together; None: no limit
    idle_unload_s: float | None = None  # unload a model with nothing in flight this long after its last request
    preload: bool = False  # load every model at start rather than at its first request
