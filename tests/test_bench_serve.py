"""`pagoda bench serve`: metric math on synthetic timestamps, and a full run against a fake
OpenAI-compatible streaming server (FastAPI under uvicorn in a thread, on a free loopback port)."""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# At module level: FastAPI resolves the handlers' (string) annotations in the module's namespace.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.bench.serve import RequestResult, arrival_offsets, compute_metrics, summarize
from pagoda.entrypoints.cli import main as cli_main

TOKEN_DELAY_S = 0.002


# ---- metric math -----------------------------------------------------------------------------------

def test_summarize_percentiles() -> None:
    s = summarize([float(x) for x in range(1, 101)])  # 1..100
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01)  # linear interpolation: 1 + 0.99 * 99
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_tpot_and_metrics_on_synthetic_timestamps() -> None:
    # Request a: first token at 0.1 s, then 4 more every 0.05 s -> e2e 0.3, TPOT (0.3-0.1)/4 = 0.05.
    a = RequestResult(prompt_len=10, requested_output_len=5, success=True, output_tokens=5, ttft=0.1,
                      itl=[0.05] * 4, latency=0.3)
    # Request b: one token only, so no TPOT; c failed and counts nowhere but "failed".
    b = RequestResult(prompt_len=20, requested_output_len=1, success=True, output_tokens=1, ttft=0.2,
                      itl=[], latency=0.2)
    c = RequestResult(prompt_len=30, requested_output_len=8, error="HTTP 500")
    assert a.tpot == pytest.approx(0.05)
    assert b.tpot is None
    m = compute_metrics([a, b, c], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_tpot_ms"] == pytest.approx(50.0)
    assert m["p99_itl_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx(250.0)
    assert m["output_len_mismatches"] == 0


def test_arrivals_seeded_and_poisson_mean() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    a = arrival_offsets(2000, 10.0, seed=3)
    assert a == arrival_offsets(2000, 10.0, seed=3)
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


# ---- fake server -----------------------------------------------------------------------------------

def _fake_app() -> FastAPI:
    app = FastAPI()
    app.state.seen = []
    flaky = itertools.count()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, usage: bool) -> AsyncIterator[str]:
        prompt = body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        for i in range(body["max_tokens"]):
            await asyncio.sleep(TOKEN_DELAY_S)
            chunk = {"id": "x", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        if usage and body.get("stream_options", {}).get("include_usage"):
            u = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"],
                 "total_tokens": n_prompt + body["max_tokens"]}
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': u})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        body = await request.json()
        app.state.seen.append(body)
        return StreamingResponse(stream(body, usage=True), media_type="text/event-stream")

    @app.post("/v1/nousage")
    async def nousage(request: Request):  # noqa: ANN202
        return StreamingResponse(stream(await request.json(), usage=False), media_type="text/event-stream")

    @app.post("/v1/flaky")
    async def flaky_route(request: Request):  # noqa: ANN202
        body = await request.json()
        if next(flaky) % 2 == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        return StreamingResponse(stream(body, usage=True), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, object]]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = _fake_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "fake server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(timeout=10)


WORKLOAD = ["--num-prompts", "6", "--input-len-range", "8", "32", "--output-len-range", "4", "12", "--seed", "1"]


def _run(args: list[str], out: Path) -> dict:
    assert cli_main(["bench", "serve", *args, "--save-result", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_serve_against_fake_server(fake_server, tmp_path: Path) -> None:
    base, app = fake_server
    app.state.seen.clear()
    rep = _run(["--base-url", base, "--prompt-format", "ids", "--max-concurrency", "3", *WORKLOAD,
                "--plot", str(tmp_path / "run.png")], tmp_path / "a.json")
    m, r = rep["metrics"], rep["requests"]
    assert rep["config"]["model"] == "fake-model"  # found through GET /v1/models
    assert (m["completed"], m["failed"]) == (6, 0)
    assert m["output_len_mismatches"] == 0
    assert r["output_lens"] == r["requested_output_lens"]
    assert m["total_output_tokens"] == sum(r["requested_output_lens"])
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert m[key] > 0, key
    # The fake server waits TOKEN_DELAY_S before every token, so no gap can be much shorter.
    assert m["median_itl_ms"] >= 0.5 * TOKEN_DELAY_S * 1000
    assert m["mean_e2el_ms"] >= m["mean_ttft_ms"]
    # What went over the wire: id lists, greedy, exact lengths, usage asked for.
    body = app.state.seen[0]
    assert isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"])
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert sorted(b["max_tokens"] for b in app.state.seen) == sorted(r["requested_output_lens"])
    assert (tmp_path / "run.png").stat().st_size > 0

    # Text prompts at a finite Poisson rate, to a server without usage: output counted from chunks.
    rep2 = _run(["--base-url", base, "--endpoint", "/v1/nousage", "--model", "fake-model",
                 "--request-rate", "50", *WORKLOAD, "--label", "text"], tmp_path / "b.json")
    assert rep2["metrics"]["completed"] == 6
    assert rep2["requests"]["output_lens"] == rep2["requests"]["requested_output_lens"]
    assert isinstance(rep2["config"]["request_rate"], float)

    # Several saved results -> the throughput/latency picture, with no server involved.
    assert cli_main(["bench", "serve", "--plot-from", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--plot", str(tmp_path / "sweep.png")]) == 0
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_bench_serve_counts_failures(fake_server, tmp_path: Path) -> None:
    base, _ = fake_server
    rep = _run(["--base-url", base, "--endpoint", "/v1/flaky", "--model", "m", "--prompt-format", "ids",
                "--max-concurrency", "1", *WORKLOAD], tmp_path / "f.json")
    assert (rep["metrics"]["completed"], rep["metrics"]["failed"]) == (3, 3)
    assert any("HTTP 500" in e for e in rep["errors"])


def test_bench_serve_unreachable_server_fails_cleanly(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = tmp_path / "u.json"
    rc = cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--timeout", "5",
                   *WORKLOAD, "--save-result", str(out)])
    assert rc == 1
    assert json.loads(out.read_text())["metrics"]["failed"] == 6


# ---- the json-schema workload --------------------------------------------------------------------------

def test_json_schema_workload_payloads_and_validation_counts() -> None:
    from pagoda.bench.datasets import SCHEMAS, json_schema_requests
    from pagoda.bench.serve import Target, _payload, schema_metrics, unconstrained_twins
    from pagoda.model.default_model import default_model_path
    from pagoda.model.tokenizer import load_tokenizer

    reqs = json_schema_requests(load_tokenizer(default_model_path()), num_prompts=8, max_tokens=64)
    assert [r.schema for r in reqs] == [SCHEMAS[i % len(SCHEMAS)] for i in range(8)]
    target = Target("http://x/v1/chat/completions", "m", True, {}, 1.0)
    body = _payload(target, "hi", reqs[1], index=1)
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": SCHEMAS[1], "strict": True}}
    assert "ignore_eos" not in body and body["max_tokens"] == 64 and body["seed"] == 1
    valid = {"city": "Oslo", "country": "Norway", "population": 700000, "coastal": True}
    results = [RequestResult(1, 64, success=True, text=json.dumps(valid), finish_reason="stop", output_tokens=20),
               RequestResult(1, 64, success=True, text='{"city": 1}', finish_reason="stop", output_tokens=5),
               RequestResult(1, 64, success=True, text='{"city": "O', finish_reason="length", output_tokens=64),
               RequestResult(1, 64, success=False)]
    picked = [reqs[2]] * 4  # SCHEMAS[2] is the city schema
    assert schema_metrics(results, picked) == {"valid": 1, "invalid": 1, "cut": 1}
    twins = unconstrained_twins(picked, results)
    assert [t.output_len for t in twins] == [20, 5, 64, 1] and all(t.schema is None for t in twins)
    free = _payload(target, "hi", twins[0], index=0)
    assert free["ignore_eos"] is True and "response_format" not in free and free["temperature"] == 0.8
    unseeded = Target("http://x/v1/chat/completions", "m", True, {}, 1.0, seeded=False)
    assert "seed" not in _payload(unseeded, "hi", reqs[1], index=1)


def test_compare_unconstrained_refuses_a_ratio_over_failed_requests() -> None:
    from pagoda.bench.serve import _all_served

    _all_served([RequestResult(1, 8, success=True)], "constrained")
    with pytest.raises(RuntimeError, match="1 of 2 requests of the unconstrained run failed.*refused"):
        _all_served([RequestResult(1, 8, success=True), RequestResult(1, 8, error="ConnectError: refused")],
                    "unconstrained")


# ---- the servers' counters (--metrics-url) ---------------------------------------------------------------

def test_server_counters_read_vllm_names_first_and_sum_labels() -> None:
    from pagoda.bench.serve import counters_report, format_counters, server_counters

    page = "\n".join([
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0',
        "# TYPE pagoda:prefix_cache_hits counter",  # the same counter under Pagoda's name: not added twice
        'pagoda:prefix_cache_hits_total{model_name="m"} 200.0',
        "# TYPE vllm:request_success counter",
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0',
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0',
        ""])
    assert server_counters(page) == {"prefix_cache_queries": 300.0, "prefix_cache_hits": 200.0, "requests": 4.0}
    # A labelled counter with no sample yet reads 0; one never declared is left out.
    assert server_counters("# TYPE pagoda:request_success counter\n") == {"requests": 0.0}
    before = [{"prefix_cache_queries": 100.0, "prefix_cache_hits": 0.0, "requests": 1.0}, {"requests": 0.0}]
    after = [server_counters(page), {"prefix_cache_queries": 100.0, "prefix_cache_hits": 100.0, "requests": 2.0}]
    report = counters_report(["a/metrics", "b/metrics"], before, after)
    assert [s["requests"] for s in report["servers"]] == [3.0, 2.0]
    assert report["servers"][0]["prefix_hit_rate"] == 1.0 and report["prefix_hit_rate"] == 300.0 / 300.0
    assert "Prefix cache hit rate: 100.0% of 300 prompt tokens" in format_counters(report)


def test_server_counters_give_the_engine_steps_and_where_their_time_goes() -> None:
    from pagoda.bench.serve import counters_report, format_counters, server_counters

    def page(steps: int, tokens: int, step_s: float, forward_s: float) -> str:
        return "\n".join([
            "# TYPE pagoda:iteration_tokens_total histogram",
            f'pagoda:iteration_tokens_total_count{{model_name="m"}} {steps}',
            f'pagoda:iteration_tokens_total_sum{{model_name="m"}} {tokens}',
            "# TYPE pagoda:engine_step_seconds histogram",
            f'pagoda:engine_step_seconds_count{{model_name="m"}} {steps}',
            f'pagoda:engine_step_seconds_sum{{model_name="m"}} {step_s}',
            "# TYPE pagoda:model_forward_seconds histogram",
            f'pagoda:model_forward_seconds_count{{model_name="m"}} {steps}',
            f'pagoda:model_forward_seconds_sum{{model_name="m"}} {forward_s}',
            ""])

    report = counters_report(["a/metrics"], [server_counters(page(10, 100, 1.0, 0.5))],
                             [server_counters(page(110, 4100, 5.0, 3.5))])
    assert "100 engine steps of 40.0 tokens: 40.0 ms a step, 30.0 ms of it the forward, 10.0 ms the rest" \
        in format_counters(report)
