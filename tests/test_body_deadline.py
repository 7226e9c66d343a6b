"""The request body has one deadline, whole: a client sending a byte now and then cannot hold a slot forever."""
from __future__ import annotations

import asyncio

from pagoda.entrypoints.server.middleware import BodyLimitMiddleware


async def _app(scope: dict, receive, send) -> None:  # noqa: ANN001 - ASGI
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _drip(every_s: float):  # noqa: ANN202 - an ASGI receive
    async def receive() -> dict:
        await asyncio.sleep(every_s)
        return {"type": "http.request", "body": b"x", "more_body": True}
    return receive


def _run(receive, timeout_s: float) -> list[dict]:  # noqa: ANN001
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    mw = BodyLimitMiddleware(_app, max_bytes=1 << 20, read_timeout_s=timeout_s)
    asyncio.run(asyncio.wait_for(mw({"type": "http", "headers": []}, receive, send), 10))
    return sent


def test_a_body_dripping_slower_than_its_deadline_is_a_408() -> None:
    sent = _run(_drip(0.05), timeout_s=0.5)  # every read is quick; the whole body never ends
    assert sent[0]["status"] == 408


def test_a_body_that_arrives_in_time_reaches_the_app() -> None:
    async def once() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}
    assert _run(once, timeout_s=0.5)[0]["status"] == 200
