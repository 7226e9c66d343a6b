"""ModelRegistry and ModelDispatcher over fake models (no engine): one load for concurrent first requests, the
LRU choice under a budget, a 409 for an unload that may not wait, idle unload, and the key on /models/load."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.responses import JSONResponse

from pagoda.entrypoints.server.errors import APIError
from pagoda.entrypoints.server.middleware import APIKeyMiddleware
from pagoda.entrypoints.server.model_dispatcher import ModelDispatcher
from pagoda.entrypoints.server.models import LoadedModel, ModelRegistry, ModelSpec, ModelState
from pagoda.entrypoints.server.settings import ModelsSettings


class FakeLoader:
    def __init__(self, size: int = 10, load_s: float = 0.05) -> None:
        self.size, self.load_s, self.loads = size, load_s, []  # type: ignore[var-annotated]
        self.threads: set[str] = set()

    def estimate_bytes(self, spec: ModelSpec) -> int:
        return self.size

    def load(self, spec: ModelSpec) -> LoadedModel:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.load_s)
        self.loads.append(spec.name)

        async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
            body = (await receive()).get("body", b"")
            await JSONResponse({"served_by": spec.name, "echo": json.loads(body or b"{}")})(scope, receive, send)

        @contextlib.asynccontextmanager
        async def lifespan() -> AsyncIterator[None]:
            yield

        return LoadedModel(app=app, lifespan=lifespan, resident_bytes=self.size)


def registry(names: list[str], loader: FakeLoader, **settings) -> ModelRegistry:  # type: ignore[no-untyped-def]
    return ModelRegistry([ModelSpec(n, f"/models/{n}") for n in names], loader, ModelsSettings(**settings))


def test_concurrent_first_requests_share_one_load_off_the_event_loop() -> None:
    async def run() -> None:
        loader = FakeLoader(load_s=0.2)
        reg = registry(["a", "b"], loader)

        async def one() -> None:
            async with reg.serving(reg.slot("a")):
                await asyncio.sleep(0.01)

        await asyncio.gather(*(one() for _ in range(5)))
        assert loader.loads == ["a"]
        assert threading.main_thread().name not in loader.threads
        assert reg.slot("a").state is ModelState.LOADED and reg.slot("b").state is ModelState.UNLOADED
    asyncio.run(run())


def test_budget_unloads_the_least_recently_used_idle_model() -> None:
    async def run() -> None:
        reg = registry(["a", "b", "c"], FakeLoader(size=10), memory_budget=25)
        for name in ("a", "b", "a", "c"):  # b is the least recently used when c needs room
            async with reg.serving(reg.slot(name)):
                pass
        states = {n: s.state for n, s in reg.slots.items()}
        assert states == {"a": ModelState.LOADED, "b": ModelState.UNLOADED, "c": ModelState.LOADED}
    asyncio.run(run())


def test_a_busy_model_is_not_unloaded_for_room() -> None:
    async def run() -> None:
        reg = registry(["a", "b"], FakeLoader(size=10), memory_budget=15)
        async with reg.serving(reg.slot("a")):
            with pytest.raises(APIError) as e:
                async with reg.serving(reg.slot("b")):
                    pass
            assert e.value.status == 503
    asyncio.run(run())


def test_unload_that_may_not_wait_is_a_409_and_one_that_waits_lets_requests_finish() -> None:
    async def run() -> None:
        reg = registry(["a"], FakeLoader())
        slot = reg.slot("a")
        finished = []

        async def request() -> None:
            async with reg.serving(slot):
                await asyncio.sleep(0.2)
                finished.append(True)

        task = asyncio.create_task(request())
        await asyncio.sleep(0.1)
        with pytest.raises(APIError) as e:
            await reg.unload(slot, wait=False)
        assert e.value.status == 409
        assert await reg.unload(slot)
        assert finished == [True] and slot.state is ModelState.UNLOADED
        await task
    asyncio.run(run())


def test_idle_models_unload() -> None:
    async def run() -> None:
        reg = registry(["a", "b"], FakeLoader(), idle_unload_s=0.05)
        async with reg.serving(reg.slot("a")):
            pass
        await asyncio.sleep(0.1)
        async with reg.serving(reg.slot("b")):
            pass
        await reg.unload_idle()
        assert reg.slot("a").state is ModelState.UNLOADED and reg.slot("b").state is ModelState.LOADED
    asyncio.run(run())


def test_dispatcher_routes_by_model_and_keeps_load_behind_the_key() -> None:
    async def run() -> None:
        reg = registry(["a", "b"], FakeLoader())
        app = APIKeyMiddleware(ModelDispatcher(reg), "k")
        auth = {"Authorization": "Bearer k"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.post("/models/load", json={"model": "b"})).status_code == 401
            r = await c.post("/v1/completions", json={"model": "b", "prompt": "x"}, headers=auth)
            assert r.json() == {"served_by": "b", "echo": {"model": "b", "prompt": "x"}}
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
            assert r.json()["served_by"] == "a"
            r = await c.post("/v1/completions", json={"model": "zz"}, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
            listed = (await c.get("/v1/models", headers=auth)).json()["data"]
            assert [(m["id"], m["status"]) for m in listed] == [("a", "loaded"), ("b", "loaded")]
            r = await c.post("/models/unload", json={"model": "b"}, headers=auth)
            assert r.json()["status"] == "unloaded"
    asyncio.run(run())
