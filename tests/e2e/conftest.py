"""Fixtures for end-to-end server tests: a real `pagoda serve` subprocess on a free loopback port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = float(os.environ.get("PAGODA_TEST_SERVER_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pagoda.entrypoints.cli serve ...` with its output in a temp log (shown on failure)."""

    def __init__(self, *extra_args: str, env: dict[str, str] | None = None, launcher: tuple[str, ...] = ()) -> None:
        """`launcher`: arguments of python before `-m pagoda.entrypoints.cli`, e.g. torchrun's module and flags."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagoda-serve-", suffix=".log", delete=False)
        # Batch files go to a folder of the test's, never the user's state folder.
        self.batch_dir = tempfile.TemporaryDirectory(prefix="pagoda-batches-")
        cmd = [sys.executable, *launcher, "-m", "pagoda.entrypoints.cli", "serve", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(self.port), "--batch-dir", self.batch_dir.name, *extra_args]
        full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "ServerProcess":
        """`with ServerProcess(...) as srv:` waits until it is ready, and stops it and removes its log after."""
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self.log.name)

    def openai(self, api_key: str = "unused", timeout: float = 120) -> Any:
        """The `openai` SDK's client of this server (no retries: a test sees the first answer)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        try:
            wait_healthy(self.url, self.proc, self.log_tail, timeout)
        except TimeoutError:
            self.stop()
            raise

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def wait_healthy(url: str, proc: subprocess.Popen, log_tail: Callable[[], str], timeout: float,
                 poll_s: float = 0.5) -> None:
    """Until `url`/health answers 200; raises if `proc` exits first or `timeout` passes (with its log's tail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s:\n{log_tail()}")


@pytest.fixture(scope="module")
def server_process() -> Iterator[ServerProcess]:
    """Started, not yet awaited: the reference model loads in-process meanwhile."""
    srv = ServerProcess("--kv-cache-memory", "256MiB", "--max-model-len", "512", "--max-num-seqs", "32")
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


@pytest.fixture(scope="module")
def server(server_process: ServerProcess, reference: dict) -> ServerProcess:
    server_process.wait_ready()
    return server_process


@pytest.fixture(scope="module")
def fuzz_api_key() -> str:
    return "pagoda-fuzz-key"


@pytest.fixture(scope="module")
def fuzz_body_limit() -> int:
    return 64 << 10


@pytest.fixture(scope="module")
def fuzz_server(fuzz_api_key: str, fuzz_body_limit: int) -> Iterator[ServerProcess]:
    """A ready server with small limits and an API key, for schema fuzzing; the embedded embedding model beside
    the chat model, so the pooling routes are fuzzed too."""
    srv = ServerProcess("--kv-cache-memory", "128MiB", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--api-key", fuzz_api_key, "--max-request-body-bytes", str(fuzz_body_limit),
                        "--max-upload-bytes", str(fuzz_body_limit),
                        "--embedding-model", "default")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)
