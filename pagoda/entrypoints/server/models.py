"""The models of a multi-model server (`pagoda serve --model A --model B`, `--models-dir`): which are loaded,
which load next, which unload to make room.

Each model is a ModelSlot: its spec (names, path), its state, and while loaded its LoadedModel, an app over its
own engine and step loop. A model loads at its first request (or at start with --preload), in a thread so the
event loop goes on serving the others; concurrent first requests wait for that one load. Loads and unloads run
one at a time (one lock), which also keeps two loads from both counting on the same free memory.

Under a memory budget a load first unloads the least recently used loaded models that have nothing in flight.
An unload never loses a request: the model stops taking new ones (they wait, then load it again), and its
engine stops once those in flight have finished. A model that fails to load stays failed, its requests
answered 500 with the reason, until `POST /models/load` tries again; the other models go on.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError
from pagoda.entrypoints.server.settings import ModelsSettings

logger = logging.getLogger(__name__)


class ModelState(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"  # taking no new requests; stops once those in flight have finished
    FAILED = "failed"


@dataclass(frozen=True)
class ModelSpec:
    name: str  # listed by /v1/models, and what requests name in `model`
    path: str  # HF folder or .gguf
    aliases: tuple[str, ...] = ()  # also accepted as `model` (the path as given)


@dataclass
class LoadedModel:
    """What serving one model holds; dropping it frees the model (its engine thread has stopped by then)."""
    app: Any  # the ASGI app over this model's engine (create_app)
    lifespan: Callable[[], AbstractAsyncContextManager[None]]  # starts the engine's step loop; stops it on exit
    resident_bytes: int  # weights and KV pool, measured once loaded
    max_model_len: int | None = None
    metrics: CollectorRegistry | None = None
    begin_shutdown: Callable[[float], None] = lambda _timeout: None  # the server got SIGTERM: start draining


class ModelLoader(Protocol):
    """Builds a model's app (in a worker thread) and says beforehand how much memory it will take."""

    def estimate_bytes(self, spec: ModelSpec) -> int: ...

    def load(self, spec: ModelSpec) -> LoadedModel: ...


@dataclass
class ModelSlot:
    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    loaded: LoadedModel | None = None
    error: str | None = None  # why the last load failed
    in_flight: int = 0  # requests inside the model's app now
    last_used: float = field(default_factory=time.monotonic)
    stack: AsyncExitStack | None = None  # the app's running lifespan


class ModelRegistry:
    """name → slot; acquire/release around each request, load/unload by hand or to fit the budget."""

    def __init__(self, specs: list[ModelSpec], loader: ModelLoader, settings: ModelsSettings) -> None:
        if not specs:
            raise ValueError("no models to serve")
        self.slots = {s.name: ModelSlot(s) for s in specs}
        if len(self.slots) != len(specs):
            raise ValueError("two models have the same name: " + ", ".join(s.name for s in specs))
        self._by_name: dict[str, ModelSlot] = {}
        for slot in self.slots.values():
            for name in (slot.spec.name, *slot.spec.aliases):
                self._by_name.setdefault(name, slot)
        self.loader, self.settings = loader, settings
        self.created = int(time.time())
        self._transition = asyncio.Lock()  # one load or unload at a time
        self._changed = asyncio.Condition()  # a slot's state or in-flight count changed
        self._stopping = False

    # ---- lookup --------------------------------------------------------------------------------
    @property
    def default(self) -> ModelSlot:
        """Where requests that name no model go: the first model given."""
        return next(iter(self.slots.values()))

    def slot(self, name: str | None) -> ModelSlot:
        """The slot `name` names (None: the default); 404 in OpenAI's shape for a name no model has."""
        if name is None:
            return self.default
        found = self._by_name.get(name)
        if found is None:
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(self.slots)}", "model")
        return found

    def cards(self) -> list[dict[str, Any]]:
        """/v1/models: every model, loaded or not, in OpenAI's shape plus its `status`."""
        out = []
        for slot in self.slots.values():
            card = P.ModelCard(id=slot.spec.name, created=self.created, root=slot.spec.path,
                               max_model_len=slot.loaded.max_model_len if slot.loaded else None).model_dump()
            card["status"] = slot.state.value
            if slot.error is not None:
                card["error"] = slot.error
            out.append(card)
        return out

    def metrics(self) -> dict[str, CollectorRegistry]:
        return {s.spec.name: s.loaded.metrics for s in self.slots.values() if s.loaded and s.loaded.metrics}

    # ---- requests ------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serving(self, slot: ModelSlot) -> AsyncIterator[LoadedModel]:
        """The model loaded and counted in flight for one request (an unload waits for it)."""
        loaded = await self._acquire(slot)
        try:
            yield loaded
        finally:
            slot.in_flight -= 1
            slot.last_used = time.monotonic()
            if slot.in_flight == 0:
                await self._notify()

    async def _acquire(self, slot: ModelSlot) -> LoadedModel:
        while True:
            if self._stopping:
                raise APIError(503, "the server is shutting down")
            # The check and the count are one synchronous step: an unload that starts later sees this request.
            if slot.state is ModelState.LOADED and slot.loaded is not None:
                slot.in_flight += 1
                slot.last_used = time.monotonic()
                return slot.loaded
            if slot.state is ModelState.FAILED:
                raise APIError(500, slot.error or f"model {slot.spec.name} failed to load", "model")
            await self.load(slot)

    # ---- load and unload -----------------------------------------------------------------------
    async def load(self, slot: ModelSlot, retry: bool = False) -> None:
        """Load `slot` unless it is loaded (the first of concurrent callers loads, the others wait for it);
        `retry`: try a failed model again. Raises APIError 503 where the budget leaves no room."""
        while True:
            await self._wait(lambda: slot.state is not ModelState.UNLOADING)
            async with self._transition:
                if slot.state is ModelState.UNLOADING:
                    continue  # an unload began while this waited for the lock
                if slot.state is ModelState.LOADED or (slot.state is ModelState.FAILED and not retry):
                    return
                if self._stopping:
                    raise APIError(503, "the server is shutting down")
                await self._make_room(slot)
                await self._set(slot, ModelState.LOADING)
                started = time.monotonic()
                stack = AsyncExitStack()
                try:
                    loaded = await asyncio.to_thread(self.loader.load, slot.spec)
                    await stack.enter_async_context(loaded.lifespan())
                except Exception as e:  # noqa: BLE001 - any failure to load is that model's alone
                    logger.exception("model %s (%s) failed to load", slot.spec.name, slot.spec.path)
                    slot.error = f"model `{slot.spec.name}` ({slot.spec.path}) failed to load: {type(e).__name__}: {e}"
                    await self._set(slot, ModelState.FAILED)
                    _free_memory()
                    return
                slot.loaded, slot.stack, slot.error = loaded, stack, None
                slot.last_used = time.monotonic()
                await self._set(slot, ModelState.LOADED)
                logger.info("model %s loaded in %.1f s (%.0f MiB)", slot.spec.name, time.monotonic() - started,
                            loaded.resident_bytes / 2**20)
                return

    async def unload(self, slot: ModelSlot, wait: bool = True) -> bool:
        """Unload `slot` once its requests in flight have finished (new ones wait and load it again); with
        `wait` False, a 409 instead while any are in flight. False where it was not loaded."""
        await self._wait(lambda: slot.state is not ModelState.LOADING)
        if slot.state is ModelState.UNLOADING:
            await self._wait(lambda: slot.state is not ModelState.UNLOADING)
            return True
        if slot.state is not ModelState.LOADED:
            return False
        if not wait and slot.in_flight:
            raise APIError(409, f"model `{slot.spec.name}` has {slot.in_flight} request(s) in flight; unload it "
                                "with \"wait\": true to let them finish first", "model")
        await self._set(slot, ModelState.UNLOADING)
        await self._wait(lambda: slot.in_flight == 0)
        async with self._transition:
            await self._teardown(slot)
        return True

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload least recently used idle models until `slot` fits the budget (under the transition lock)."""
        budget = self.settings.memory_budget
        if budget is None:
            return
        need = self.loader.estimate_bytes(slot.spec)
        if need > budget:
            raise APIError(503, f"model `{slot.spec.name}` needs about {need >> 20} MiB, more than the whole "
                                f"--models-memory budget of {budget >> 20} MiB", "model")
        while self.resident_bytes() + need > budget:
            idle = [s for s in self.slots.values() if s.state is ModelState.LOADED and s.in_flight == 0]
            if not idle:
                raise APIError(503, f"no room for model `{slot.spec.name}` in --models-memory: every loaded model "
                                    "has requests in flight; retry", "model", headers={"Retry-After": "1"})
            victim = min(idle, key=lambda s: s.last_used)
            logger.info("unloading model %s (least recently used) to make room for %s", victim.spec.name,
                        slot.spec.name)
            await self._teardown(victim)

    async def _teardown(self, slot: ModelSlot) -> None:
        """Stop the model's app and drop it (under the transition lock, with nothing in flight)."""
        loaded, stack = slot.loaded, slot.stack
        if loaded is None or stack is None:
            return
        slot.state = ModelState.UNLOADING  # synchronously with the caller's check that it is idle
        try:
            await stack.aclose()  # the app's lifespan: the engine's step loop stops
        except Exception:  # noqa: BLE001 - the model is being dropped either way
            logger.exception("model %s did not stop cleanly", slot.spec.name)
        finally:
            slot.loaded = slot.stack = None
            del loaded, stack
            _free_memory()
            await self._set(slot, ModelState.UNLOADED)
        logger.info("model %s unloaded", slot.spec.name)

    def resident_bytes(self) -> int:
        """What the loaded models hold (one unloading still holds its memory)."""
        return sum(s.loaded.resident_bytes for s in self.slots.values() if s.loaded is not None)

    async def unload_idle(self) -> None:
        """Unload the models nobody has used for --models-idle-unload seconds."""
        limit = self.settings.idle_unload_s
        if limit is None:
            return
        now = time.monotonic()
        for slot in self.slots.values():
            if slot.state is ModelState.LOADED and slot.in_flight == 0 and now - slot.last_used >= limit:
                with contextlib.suppress(APIError):  # a request arrived meanwhile: it stays
                    await self.unload(slot, wait=False)

    # ---- the server's start and end ------------------------------------------------------------
    async def preload(self) -> None:
        """Load every model in order (as far as the budget allows; a failure is that model's)."""
        for slot in self.slots.values():
            try:
                await self.load(slot)
            except APIError as e:
                logger.warning("--preload: %s", e.message)

    def begin_shutdown(self, timeout: float) -> None:
        """SIGTERM: every loaded model stops taking requests and drains for `timeout` s from now."""
        self._stopping = True
        for slot in self.slots.values():
            if slot.loaded is not None:
                slot.loaded.begin_shutdown(timeout)

    async def close(self) -> None:
        """Stop every loaded model (each app's lifespan drains its engine)."""
        self._stopping = True
        async with self._transition:
            for slot in self.slots.values():
                await self._teardown(slot)

    # ---- state changes -------------------------------------------------------------------------
    async def _set(self, slot: ModelSlot, state: ModelState) -> None:
        slot.state = state
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, ready: Callable[[], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(ready)


def _free_memory() -> None:
    """Collect the dropped model's reference cycles now, and hand the heap's free pages back to the OS (glibc
    keeps freed small allocations for reuse otherwise, and the process's RSS would not drop)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
