"""The error that ends a tensor-parallel engine."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited: the engine cannot go on (the step's requests, and every later one, fail)."""
