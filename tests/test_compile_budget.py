"""A request's grammar compile has a deadline and ends with its client, without holding the server's threads."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from pagoda import SamplingParams
from pagoda.entrypoints.server.errors import APIError
from pagoda.entrypoints.server.serving import Serving
from pagoda.entrypoints.server.settings import ServerSettings


class _Core:
    def __init__(self) -> None:
        self.future: Future = Future()  # a compile that never ends (queued: not started)

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


def _serving(timeout: float) -> tuple[Serving, _Core]:
    s = Serving.__new__(Serving)
    s.core = _Core()
    s.settings = ServerSettings(served_model_names=["m"], structured_outputs_compile_timeout=timeout)
    return s, s.core


PARAMS = SamplingParams(structured_outputs={"regex": "a+"})


def test_a_compile_past_its_deadline_is_a_400_naming_the_flag() -> None:
    s, core = _serving(0.2)
    with pytest.raises(APIError) as e:
        asyncio.run(s.compile_constraint(PARAMS, _Request(None)))
    assert e.value.status == 400 and "--structured-outputs-compile-timeout" in str(e.value)
    assert core.future.cancelled()  # it had not started: it never will


def test_a_compile_whose_client_left_is_dropped() -> None:
    s, core = _serving(30)
    with pytest.raises(APIError) as e:
        asyncio.run(s.compile_constraint(PARAMS, _Request(0.1)))
    assert e.value.status == 499 and core.future.cancelled()


def test_a_compile_error_is_the_requests_400() -> None:
    s, core = _serving(30)
    core.future.set_exception(ValueError("structured_outputs: the regex does not compile: bad"))
    with pytest.raises(APIError) as e:
        asyncio.run(s.compile_constraint(PARAMS, _Request(None)))
    assert e.value.status == 400 and "does not compile" in str(e.value)
