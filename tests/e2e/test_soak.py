"""A bounded disconnect soak (marker `soak`, run by CI on its own): a few hundred requests through a KV pool
small enough to preempt, 15% of clients vanishing mid-request. Nothing is lost, nothing hangs, and the KV
pool is empty afterwards."""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.soak

MODEL = "SmolLM2-135M-Instruct"
NUM_REQUESTS = 300
CONCURRENCY = 16
VANISH_RATE = 0.15
REQUEST_TIMEOUT_S = 120
SOAK_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # 24 MiB of fp32 KV: ~34 blocks of 16 tokens for 16 requests of up to ~100 tokens, so the scheduler preempts.
    with ServerProcess("--kv-cache-memory", "24MiB", "--max-model-len", "256",
                       "--max-num-seqs", str(CONCURRENCY)) as srv:
        yield srv


def _metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


async def _one(http: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """Send request i; return its outcome: 'ok', 'vanished', or a description of what went wrong."""
    max_tokens = rng.randint(16, 80)
    stream, chat, vanish = rng.random() < 0.5, rng.random() < 0.5, rng.random() < VANISH_RATE
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "seed": i}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Request {i}: tell me about the number {i * 7}."}]
    else:
        path = "/v1/completions"
        body["prompt"] = f"Request {i}: the number {i * 7} is"
    if stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            usage, chunks = None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                if vanish and chunks >= 3:
                    return "vanished"  # leaving the block drops the connection mid-stream
                if '"error"' in line:
                    return f"error event {line[:200]}"
                if '"usage": {' in line or '"usage":{' in line:
                    usage = httpx.Response(200, content=line[6:]).json()["usage"]
            if usage is None or usage["completion_tokens"] != max_tokens:
                return f"stream usage {usage} != {max_tokens}"
            return "ok"
    if vanish:
        try:
            await http.post(path, json=body, timeout=rng.uniform(0.2, 1.5))
        except httpx.TimeoutException:
            return "vanished"
        return "ok"  # finished before the client gave up
    r = await http.post(path, json=body)
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    got = r.json()["usage"]["completion_tokens"]
    return "ok" if got == max_tokens else f"usage {got} != {max_tokens}"


def test_disconnect_soak_loses_nothing_and_leaks_no_block(server: ServerProcess) -> None:
    rng = random.Random(17)
    before = _metrics(httpx.get(f"{server.url}/metrics").text)

    async def main() -> Counter:
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
            async def bounded(i: int) -> str:
                async with sem:
                    start = time.monotonic()
                    try:
                        outcome = await _one(http, i, random.Random(rng.random()))
                    except httpx.TimeoutException:
                        return "hung"
                    if outcome == "ok":
                        latencies.append(time.monotonic() - start)
                    return outcome
            outcomes = await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS))),
                                              SOAK_TIMEOUT_S)
        return Counter(outcomes)

    latencies: list[float] = []
    t0 = time.monotonic()
    outcomes = asyncio.run(main())
    elapsed = time.monotonic() - t0
    bad = {k: v for k, v in outcomes.items() if k not in ("ok", "vanished")}
    assert not bad, bad
    assert outcomes["vanished"] >= NUM_REQUESTS * VANISH_RATE / 2
    # Everything the vanished clients left is aborted and freed.
    deadline = time.monotonic() + 30
    while True:
        after = _metrics(httpx.get(f"{server.url}/metrics").text)
        idle = after["pagoda:num_requests_running"] == 0 and after["pagoda:num_requests_waiting"] == 0
        if idle and after["pagoda:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and after["pagoda:kv_cache_usage_perc"] == 0, after
    preemptions = after["pagoda:num_preemptions_total"] - before["pagoda:num_preemptions_total"]
    assert preemptions > 0, "the soak is meant to run through preemption"
    assert httpx.get(f"{server.url}/health").status_code == 200
    print(f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.0f} s at concurrency {CONCURRENCY}: {outcomes['ok']} ok, "
          f"{outcomes['vanished']} vanished, 0 lost, 0 hung; slowest request {max(latencies):.1f} s, median "
          f"{sorted(latencies)[len(latencies) // 2]:.1f} s; {preemptions:.0f} preemptions; KV usage back to 0")
