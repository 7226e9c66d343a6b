"""vLLM's CPU pooling runner as the third side of `pagoda bench embed`.

`peer_scripts/vllm_embed.py` runs under the vLLM venv's python (vllm_peer.py says where that venv lives)
and keeps one engine alive for the whole bench: it answers a command per line on stdin with a JSON line on
stdout, so the bench alternates vLLM's rounds and batch-1 requests with the other sides' as it alternates
those. Its timings are taken inside the peer, around `LLM.embed`; the pipe is not timed. Engine start-up
(about a minute, mostly compilation) comes before any timed run.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from pagoda.bench.vllm_peer import RESULT_PREFIX, VLLM_ENV, PeerFailed, PeerUnavailable, check_python

SCRIPT = Path(__file__).resolve().parent / "peer_scripts" / "vllm_embed.py"
JOB_VERSION = 1
# After each step vLLM's worker keeps polling its shared-memory queue for 1 s before it sleeps
# (shm_broadcast.SpinCondition, busy_loop_s); the bench waits this long before it times another side.
IDLE_S = 1.2
STARTUP_TIMEOUT_S = 1200.0
CALL_TIMEOUT_S = 600.0

# "Type: message" at the end of a log line, after vLLM's "(EngineCore pid=N) ERROR date [file:line] " prefix.
_ERROR_LINE = re.compile(r"(?:^|\] |^\(\S+ pid=\d+\) )([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
# The wrappers vLLM raises around the root cause, in its parent processes.
_GENERIC = ("Engine core initialization failed", "WorkerProc initialization failed", "See root cause",
            "See stack trace")


def failure_reason(log: str) -> str:
    """One line saying why vLLM failed, from its log: the first exception that is not one of vLLM's wrappers
    ("Engine core initialization failed. See root cause above."), else the last exception, else the last line."""
    errors = [f"{m.group(1)}: {m.group(2).strip()}" for line in log.splitlines()
              if (m := _ERROR_LINE.search(line.strip()))]
    specific = [e for e in errors if not any(g in e for g in _GENERIC)]
    if specific:
        return specific[0]
    if errors:
        return errors[-1]
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def bind_env(cores: Sequence[int] | None) -> dict[str, str]:
    """vLLM's CPU settings (vllm_peer.VLLM_ENV), bound to `cores` (the cores and threads Pagoda runs on) where
    given, one OpenMP thread per core."""
    if not cores:
        return dict(VLLM_ENV)
    return {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
            "OMP_NUM_THREADS": str(len(cores))}


class VllmEmbedPeer:
    """One vLLM engine over the bench's sentences: `start()` waits for it to load and returns the embeddings of
    the first `check` sentences; then `throughput()` and `latency(i)` time one call each. Use it as a context
    manager, so that the engine goes away with the bench."""

    def __init__(self, python: str, model: str, texts: Sequence[str], *, batch_size: int, max_model_len: int,
                 dtype: str, cores: Sequence[int] | None = None, check: int | None = None,
                 log_path: str, job_path: str) -> None:
        check_python(python)
        if not SCRIPT.is_file():
            raise PeerUnavailable(f"the vLLM peer script is missing from the install: {SCRIPT}")
        self.python, self.log_path, self.job_path = python, log_path, job_path
        self.env = bind_env(cores)
        self.job = {"version": JOB_VERSION, "model": model, "dtype": dtype, "max_model_len": int(max_model_len),
                    "batch_size": int(batch_size), "texts": list(texts),
                    "check": int(check if check is not None else batch_size)}
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log: IO[str] | None = None

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        """Launch the engine; its "ready" answer (version, startup_s, embeddings)."""
        with open(self.job_path, "w", encoding="utf-8") as f:
            json.dump(self.job, f)
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        # cwd: nothing in the caller's folder shadows the peer's modules. A session of its own, so that
        # close() can end the engine processes vLLM spawns along with it.
        self.proc = subprocess.Popen([self.python, str(SCRIPT), self.job_path],
                                     cwd=os.path.dirname(self.job_path) or ".", env={**os.environ, **self.env},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        return self._receive(timeout_s)

    def throughput(self, timeout_s: float = CALL_TIMEOUT_S) -> float:
        """Embed every sentence in one call (vLLM's scheduler forms the batches); sentences per second."""
        return float(self._call({"op": "throughput"}, timeout_s)["sentences_per_s"])

    def latency(self, index: int, timeout_s: float = CALL_TIMEOUT_S) -> float:
        """Embed sentence `index` alone; milliseconds."""
        return float(self._call({"op": "latency", "index": int(index)}, timeout_s)["latency_ms"])

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):  # it may have died already
                    if proc.poll() is None:
                        proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(timeout=wait_s)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmEmbedPeer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- the pipe -----------------------------------------------------------------------------------
    def _read(self, stream: IO[str] | None) -> None:
        if stream is not None:
            for line in stream:
                self._lines.put(line)
        self._lines.put(None)  # EOF: the peer exited

    def _call(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.proc is None or self.proc.stdin is None:
            raise PeerFailed("the vLLM peer is not running")
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died: _receive reads why from its log
            pass
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                self.close()
                raise PeerFailed(f"no answer in {timeout_s:g} s") from None
            if line is None or line.startswith(RESULT_PREFIX):
                break
        result = json.loads(line[len(RESULT_PREFIX):]) if line is not None else None
        if result is None or "error" in result:
            self.close()
            raise PeerFailed(failure_reason(_read_text(self.log_path)))
        return dict(result)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""
