"""The OpenAI-compatible HTTP server (`pagoda serve`)."""
from __future__ import annotations

__all__ = ["create_app", "ServerSettings"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: `pagoda --help` must not import FastAPI
    if name in __all__:
        from pagoda.entrypoints.server import app
        return getattr(app, name)
    raise AttributeError(name)
