"""The server's side of a grammar compile: awaited without holding a thread, cancelled (its worker killed) when
the last client waiting for it leaves, a 400 for the constraint's failures and a 503 when the server stops."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from pagoda import SamplingParams
from pagoda.entrypoints.server.errors import APIError
from pagoda.entrypoints.server.serving import Serving
from pagoda.entrypoints.server.settings import ServerSettings
from pagoda.structured.compile_workers import CompileBudgetError, CompileCancelled


class _Core:
    def __init__(self) -> None:
        self.future: Future = Future()  # a compile that has not ended

    def start_compile(self, params: SamplingParams) -> Future:
        return self.future


class _Request:
    def __init__(self, leaves_after: float | None) -> None:
        self.leaves_after = leaves_after

    async def receive(self) -> dict:
        if self.leaves_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.leaves_after)
        return {"type": "http.disconnect"}


def _serving() -> tuple[Serving, _Core]:
    s = Serving.__new__(Serving)
    s.inputs = _Core()
    s.settings = ServerSettings(served_model_names=["m"])
    s._compile_waiters = {}
    return s, s.inputs


PARAMS = SamplingParams(structured_outputs={"regex": "a+"})


def _status(s: Serving, request: _Request) -> int:
    with pytest.raises(APIError) as e:
        asyncio.run(s.compile_constraint(PARAMS, request))
    return e.value.status


def test_a_compile_whose_only_client_left_is_cancelled() -> None:
    s, core = _serving()
    assert _status(s, _Request(0.1)) == 499 and core.future.cancelled()


def test_a_compile_another_client_still_waits_for_runs_on() -> None:
    s, core = _serving()

    async def both() -> list[object]:
        staying = asyncio.create_task(s.compile_constraint(PARAMS, _Request(None)))
        leaving = asyncio.create_task(s.compile_constraint(PARAMS, _Request(0.1)))
        await asyncio.sleep(0.3)
        assert not core.future.cancelled()  # the leaving one did not cancel it for the other
        core.future.set_result("compiled")
        return await asyncio.gather(staying, leaving, return_exceptions=True)

    staying, leaving = asyncio.run(both())
    assert staying is None and isinstance(leaving, APIError) and leaving.status == 499
    assert not s._compile_waiters


@pytest.mark.parametrize("error, status", [
    (ValueError("structured_outputs: the regex does not compile: bad"), 400),
    (CompileBudgetError("structured_outputs: the regex did not compile within 1 s"), 400),
    (CompileCancelled(), 503),
])
def test_a_compile_failure_is_the_requests_error(error: Exception, status: int) -> None:
    s, core = _serving()
    core.future.set_exception(error)
    assert _status(s, _Request(None)) == status
