"""Interactive requests beside bulk work: `python -m benchmarks.priority [--dtype bfloat16]`.

For each scheduling policy (priority, fcfs) one `pagoda serve` answers, in turn:
  idle     the time to first token of a short interactive chat request (priority 0), alone;
  streams  the same while `--streams` low-priority streams (priority 10) decode;
  batch    the same while a /v1/batches job of `--batch-lines` lines runs (the lowest priority);
and the batch job's wall time against the same lines sent to /v1/chat/completions, `--max-num-seqs` at once.
Each TTFT is the median of `--probes` requests, one after another; beside them, the server's own mean TTFT over the
same probes (its histogram, from arrival to first token). Prints one table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx

from tests.e2e.conftest import MODEL_NAME, ServerProcess

PROBE = [{"role": "user", "content": "Say hello in one word."}]


async def ttft(client: httpx.AsyncClient, priority: int = 0) -> float:
    body = {"model": MODEL_NAME, "messages": PROBE, "max_tokens": 2, "temperature": 0, "stream": True,
            "priority": priority}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


async def server_ttft(client: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram: from a request's arrival to its first token."""
    text = (await client.get("/metrics")).text
    found = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^pagoda:time_to_first_token_seconds_(sum|count)\{[^}]*\} (\S+)$", text, re.M)}
    return found["sum"], found["count"]


async def probes(client: httpx.AsyncClient, n: int, server: dict[str, float] | None = None) -> float:
    """The median client TTFT of `n` probes; with `server`, also the server's mean TTFT over them in its "server"
    key (only where nothing else finishes meanwhile: the histogram counts every request)."""
    before = await server_ttft(client) if server is not None else None
    out = []
    for _ in range(n):
        out.append(await ttft(client))
        await asyncio.sleep(0.3)
    if server is not None and before is not None:
        after = await server_ttft(client)
        server["server"] = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    return statistics.median(out)


def bulk_body(i: int, tokens: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}]}


async def with_streams(client: httpx.AsyncClient, args: argparse.Namespace, server: dict[str, float]) -> float:
    async def stream(i: int) -> None:
        body = {**bulk_body(i, 2048), "stream": True, "priority": 10}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    await asyncio.sleep(args.settle)
    try:
        return await probes(client, args.probes, server)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(1.0)


async def with_batch(client: httpx.AsyncClient, args: argparse.Namespace) -> tuple[float, float]:
    lines = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": bulk_body(i, args.batch_tokens)}) + "\n" for i in range(args.batch_lines))
    up = (await client.post("/v1/files", files={"file": ("job.jsonl", lines.encode())},
                            data={"purpose": "batch"})).json()
    t0 = time.perf_counter()
    batch = (await client.post("/v1/batches", json={"input_file_id": up["id"], "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"})).json()
    await asyncio.sleep(args.settle)
    probe = await probes(client, args.probes)
    while batch["status"] not in ("completed", "failed", "cancelled"):
        await asyncio.sleep(0.2)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    assert batch["request_counts"]["completed"] == args.batch_lines, batch
    return probe, time.perf_counter() - t0


async def direct(client: httpx.AsyncClient, args: argparse.Namespace) -> float:
    slots = asyncio.Semaphore(args.max_num_seqs)

    async def one(i: int) -> None:
        async with slots:
            r = await client.post("/v1/chat/completions", json=bulk_body(i, args.batch_tokens))
            r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.batch_lines)))
    return time.perf_counter() - t0


async def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await probes(client, 2)  # warm-up
        idle_server: dict[str, float] = {}
        streams_server: dict[str, float] = {}
        row = {"idle": await probes(client, args.probes, idle_server)}
        row["streams"] = await with_streams(client, args, streams_server)
        row["idle_server"], row["streams_server"] = idle_server["server"], streams_server["server"]
        row["batch"], row["batch_s"] = await with_batch(client, args)
        row["direct_s"] = await direct(client, args)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--batch-lines", type=int, default=128)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--probes", type=int, default=7)
    p.add_argument("--settle", type=float, default=3.0, help="seconds the bulk runs before the first probe")
    args = p.parse_args(argv)
    rows = {}
    for policy in ("priority", "fcfs"):
        with tempfile.TemporaryDirectory() as batch_dir:
            srv = ServerProcess("--dtype", args.dtype, "--scheduling-policy", policy, "--max-num-seqs",
                                str(args.max_num_seqs), "--kv-cache-memory", "1GiB", "--max-model-len", "4096",
                                "--batch-dir", batch_dir)
            try:
                srv.wait_ready()
                rows[policy] = asyncio.run(measure(srv.url, args))
            finally:
                srv.stop()
        print(policy, {k: round(v, 3) for k, v in rows[policy].items()}, file=sys.stderr, flush=True)
    print("| policy | TTFT idle | with streams | with a batch job | batch job wall | same lines direct "
          "| server's TTFT idle / with streams |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in rows.items():
        print(f"| {policy} | {r['idle'] * 1e3:.0f} ms | {r['streams'] * 1e3:.0f} ms ({r['streams'] / r['idle']:.2f}x) "
              f"| {r['batch'] * 1e3:.0f} ms ({r['batch'] / r['idle']:.2f}x) | {r['batch_s']:.1f} s "
              f"| {r['direct_s']:.1f} s ({r['direct_s'] / r['batch_s']:.2f}x) "
              f"| {r['idle_server'] * 1e3:.0f} / {r['streams_server'] * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
