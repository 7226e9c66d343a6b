"""The server's LoRA adapters by name (vLLM's --lora-modules, /v1/load_lora_adapter, /v1/unload_lora_adapter).

A request picks an adapter by naming it in its `model` field. Unloading a name stops new requests from
choosing it; requests already running keep their adapter until they finish (the engine pins its slot).
"""
from __future__ import annotations

import asyncio
import itertools

from fastapi import APIRouter, Response

from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError
from pagoda.lora.request import LoRARequest


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """`--lora-modules name=path ...` as {name: path}."""
    modules: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
        modules[name] = path
    return modules


class LoRAAdapters:
    """Adapter name -> LoRARequest; each load gets a fresh lora_int_id, so a name reloaded from another
    path never meets the old adapter's slot."""

    def __init__(self, engine: AsyncEngine, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def _request(self, name: str, path: str) -> LoRARequest:
        if not name or name in self.base_names:
            raise APIError(400, f"lora_name {name!r} is empty or names the base model", "lora_name")
        if name in self.adapters:
            raise APIError(400, f"LoRA adapter {name!r} is already loaded: unload it first", "lora_name")
        return LoRARequest(name, next(self._ids), path)

    def load_now(self, name: str, path: str) -> None:
        """Check and register an adapter (at start: --lora-modules); ValueError naming it otherwise."""
        lora = self._request(name, path)
        self.engine.check_lora(lora)
        self.adapters[name] = lora

    async def load(self, name: str, path: str) -> None:
        lora = self._request(name, path)
        try:
            await asyncio.to_thread(self.engine.check_lora, lora)  # reads the files: off the event loop
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from e
        if name in self.adapters:  # loaded by a concurrent call meanwhile
            raise APIError(400, f"LoRA adapter {name!r} is already loaded: unload it first", "lora_name")
        self.adapters[name] = lora

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"LoRA adapter {name!r} is not loaded", "lora_name")

    def cards(self, max_model_len: int) -> list[P.ModelCard]:
        """/v1/models entries: each adapter with its base model as parent."""
        return [P.ModelCard(id=name, root=lora.lora_path, parent=self.base_names[0], max_model_len=max_model_len)
                for name, lora in self.adapters.items()]


def lora_router(adapters: LoRAAdapters) -> APIRouter:
    """vLLM's runtime adapter routes (behind the API key like every /v1 route)."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(req: P.LoadLoRAAdapterRequest) -> Response:
        await adapters.load(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: P.UnloadLoRAAdapterRequest) -> Response:
        adapters.unload(req.lora_name)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    return router

