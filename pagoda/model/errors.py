"""ModelFileError: a model file (config.json, a safetensors shard, a GGUF) that cannot be loaded."""
from __future__ import annotations

import os

_MAX_PROBLEM = 1000  # characters


class ModelFileError(ValueError):
    """A malformed or inconsistent model file. str() is one line: '<path>: <problem>'.

    A ValueError, so the CLI reports it as `error: ...` and exits 2, with no traceback."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        # Library messages (JSON decoders, safetensors) can span lines; the CLI prints exactly one.
        problem = " ".join(part.strip() for part in str(problem).splitlines() if part.strip())
        # A corrupt header can name a "tensor" with a megabyte of garbage: keep the line readable.
        self.problem = problem if len(problem) <= _MAX_PROBLEM else problem[:_MAX_PROBLEM] + "..."
        super().__init__(f"{self.path}: {self.problem}")

    def __reduce__(self) -> tuple[type[ModelFileError], tuple[str, str]]:
        # Two-argument __init__: the default reduce (args = (message,)) would not unpickle across processes.
        return type(self), (self.path, self.problem)
