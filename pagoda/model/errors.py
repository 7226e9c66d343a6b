"""What is wrong with a model file (config.json, a safetensors shard, a GGUF): ModelFileError when it cannot
be loaded, a warning when a weight is not finite."""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

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


def warn_nonfinite(t: torch.Tensor, name: str, path: str) -> None:
    """Log a warning naming the tensor and file when a weight holds NaN or Inf (it still loads)."""
    # One reduction pass in the tensor's own dtype (a float32 sum of bf16, or an isfinite mask, takes a much
    # slower path): any NaN/Inf makes the sum non-finite. An overflowing sum of finite values
    # (a large fp16 norm) only costs the exact count below, which rules it out.
    if t.is_floating_point() and t.numel() and not torch.isfinite(t.sum()):
        bad = t.numel() - int(torch.isfinite(t).sum())
        if bad:
            logger.warning("%s: tensor %s has %d non-finite value(s) (NaN/Inf) of %d; outputs will be garbage",
                           path, name, bad, t.numel())
