"""Data parallelism: Pagoda replicas behind vllm-router (docs/deployment.md), driven by the official openai client.

Two real replicas (one torch thread each) and a real vllm-router on loopback are shared by the module; the test
that kills a replica runs last. `pagoda serve --data-parallel-size 2 --api-key` (its front, keyed router and
replicas) is shared by the launcher tests, the last of which stops it."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.bench.datasets import load_corpus
from pagoda.bench.serve import server_counters
from pagoda.entrypoints.cli import main as cli_main
from pagoda.entrypoints.server import data_parallel, front
from tests.e2e.conftest import ServerProcess, free_port, wait_healthy

MODEL_NAME = "SmolLM2-135M-Instruct"
REPLICA_ARGS = ("--kv-cache-memory", "128MiB", "--max-model-len", "512", "--max-num-seqs", "16")
ROUTER = shutil.which("vllm-router")
needs_router = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")


class RouterProcess:
    """vllm-router on a free loopback port in front of `workers`."""

    def __init__(self, workers: list[str], policy: str = "cache_aware") -> None:
        assert ROUTER is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # the router's own Prometheus page
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log", delete=False)
        cmd = [ROUTER, "--worker-urls", *workers, "--host", "127.0.0.1", "--port", str(self.port), "--policy",
               policy, "--worker-startup-check-interval", "1", "--prometheus-port", str(metrics_port),
               *data_parallel.ROUTER_FAILOVER_ARGS]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> None:
        wait_healthy(self.url, self.proc, lambda: Path(self.log.name).read_text(), timeout, poll_s=0.2)

    def stop(self) -> None:
        self.proc.terminate()  # the router can sit in its graceful shutdown with idle client connections open
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    servers = [ServerProcess(*REPLICA_ARGS, env={"OMP_NUM_THREADS": "1"}) for _ in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()
            os.unlink(s.log.name)


@pytest.fixture(scope="module")
def router(replicas: list[ServerProcess]) -> Iterator[RouterProcess]:
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    r = RouterProcess([s.url for s in replicas])
    try:
        r.wait_ready()
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def samples(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def counters(servers: list[ServerProcess]) -> list[dict[str, float]]:
    return [server_counters(httpx.get(f"{s.url}/metrics", timeout=10).text) for s in servers]


def deltas(before: list[dict[str, float]], after: list[dict[str, float]], key: str) -> list[float]:
    return [a[key] - b[key] for b, a in zip(before, after)]


def prefixes(n: int, words: int, offset: int) -> list[str]:
    """`n` long, different shared prefixes cut from the benchmark corpus."""
    corpus = load_corpus().split()
    return [f"Document {offset + g}. " + " ".join(corpus[(offset + g) * words:(offset + g + 1) * words]) + "\n"
            for g in range(n)]


def ask(client: openai.OpenAI, prompt: str, max_tokens: int = 2) -> openai.types.Completion:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


# ---- the endpoints a router and vLLM's tools read ---------------------------------------------------------
@needs_router
def test_endpoints_answer_as_vllm_does(replicas: list[ServerProcess], router: RouterProcess,
                                       client: openai.OpenAI) -> None:
    # /v1/models through the router (it forwards to a worker): vLLM's fields.
    (model,) = client.models.list().data
    assert (model.id, model.object) == (MODEL_NAME, "model")
    extra = model.model_extra or {}
    assert extra["root"] == MODEL_NAME and extra["parent"] is None and extra["max_model_len"] == 512
    assert extra["permission"][0]["object"] == "model_permission"
    health = httpx.get(f"{replicas[0].url}/health")
    assert (health.status_code, health.content) == (200, b"")
    # The router's load view polls each worker's /get_load (vllm-router's power_of_two reads the same).
    loads = httpx.get(f"{router.url}/get_loads").json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(s.url for s in replicas)
    assert all(w["load"] == 0 for w in loads)  # -1 would mean the worker did not answer
    info = httpx.get(f"{router.url}/get_server_info").json()["vllm_config"]
    assert info["cache_config"]["block_size"] == 16 and info["model_config"]["max_model_len"] == 512
    assert httpx.get(f"{router.url}/get_model_info").json()["is_generation"] is True
    assert httpx.get(f"{router.url}/health_generate", timeout=60).status_code == 200
    flushed = httpx.post(f"{router.url}/flush_cache")  # fans out to every worker's POST /flush_cache
    assert flushed.status_code == 200 and "all servers" in flushed.text
    # vLLM's render routes: the token ids /v1/completions and /v1/chat/completions would run.
    url = replicas[0].url
    prompt, chat = "The capital of France is", [{"role": "user", "content": "Hi"}]
    (rendered,) = httpx.post(f"{url}/v1/completions/render", json={"model": MODEL_NAME, "prompt": prompt}).json()
    assert rendered["token_ids"] == httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert rendered["model"] == MODEL_NAME and rendered["request_id"].startswith("cmpl-")
    chat_ids = httpx.post(f"{url}/v1/chat/completions/render", json={"messages": chat, "temperature": 0.5}).json()
    assert chat_ids["sampling_params"]["temperature"] == 0.5
    assert len(chat_ids["token_ids"]) == client.chat.completions.create(
        model=MODEL_NAME, messages=chat, max_tokens=1).usage.prompt_tokens
    # ... which the router's cache_aware policy reads to match prefixes by tokens.
    router_metrics = httpx.get(router.metrics_url).text
    assert 'vllm_router_kv_routing_inputs_total{transport="http",result="render"}' in router_metrics
    # /metrics: vLLM's names with its engine label, the same values as Pagoda's own names.
    direct = replicas[0].openai()
    ask(direct, "The capital of France is")
    text = httpx.get(f"{replicas[0].url}/metrics").text
    values = samples(replicas[0].url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "request_success_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "request_prompt_tokens_count"):
        assert values[f"vllm:{name}"] == values[f"pagoda:{name}"], name
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL_NAME}"}}' in text
    assert 'block_size="16"' in next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info"))


# ---- cache-aware routing ------------------------------------------------------------------------------------
def seed(client: openai.OpenAI, groups: list[str]) -> None:
    """Each group's first request, sent while the earlier groups' still run: cache_aware sends a prefix it has not
    seen to the replica with the fewest requests in flight, so the groups spread over the replicas."""
    with cf.ThreadPoolExecutor(len(groups)) as pool:
        futures = []
        for prefix in groups:
            futures.append(pool.submit(ask, client, prefix + "Summary:", 32))
            time.sleep(0.2)
        for f in futures:
            assert f.result().choices[0].finish_reason == "length"


def owners(replicas: list[ServerProcess], groups: list[str]) -> list[int]:
    """The replica that has each group's prefix cached, found by asking both directly (each ask then caches
    it there too, so this comes last): exactly one must have it."""
    found = []
    for g, prefix in enumerate(groups):
        hits = []
        for r in replicas:
            direct = r.openai()
            before = counters([r])
            ask(direct, prefix + "Probe:", 1)
            hits.append(deltas(before, counters([r]), "prefix_cache_hits")[0])
        assert sorted(h >= 64 for h in hits) == [False, True], f"group {g}: prefix hits per replica {hits}"
        found.append(max(range(len(hits)), key=hits.__getitem__))
    return found


@needs_router
def test_cache_aware_router_keeps_each_shared_prefix_on_one_replica(replicas: list[ServerProcess],
                                                                   router: RouterProcess,
                                                                   client: openai.OpenAI) -> None:
    groups, per_group = prefixes(4, 150, offset=0), 3
    httpx.post(f"{router.url}/flush_cache").raise_for_status()
    seed(client, groups)
    # Then the groups' other requests, all at once: nothing lost, nothing served twice, each prefix found.
    before = counters(replicas)
    prompts = [f"{p}Question {q}: what is this document about?" for p in groups for q in range(per_group)]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: ask(client, p, max_tokens=8), prompts))
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 8 for o in outs)
    after = counters(replicas)
    assert sum(deltas(before, after, "requests")) == len(prompts)
    # Each ~200-token prefix is on its replica already: only the question and the last partial block miss.
    hit_rate = sum(deltas(before, after, "prefix_cache_hits")) / sum(deltas(before, after, "prefix_cache_queries"))
    assert hit_rate > 0.8
    assert set(owners(replicas, groups)) == {0, 1}, "the router sent every group to one replica"


@needs_router
def test_bench_serve_reads_the_prefix_hit_rate_of_each_replica(replicas: list[ServerProcess], router: RouterProcess,
                                                               tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "dp.json"
    code = cli_main(["bench", "serve", "--base-url", router.url, "--dataset", "prefix", "--num-prompts", "8",
                     "--num-prefixes", "2", "--prefix-len", "64", "--question-len", "8", "--output-len-range", "2",
                     "4", "--max-concurrency", "4", "--reset-prefix-cache", "--metrics-url",
                     *(f"{s.url}/metrics" for s in replicas), "--save-result", str(out)])
    assert code == 0
    assert "Prefix cache hit rate:" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["metrics"]["completed"] == 8
    srv = report["server_counters"]
    assert sum(s["requests"] for s in srv["servers"]) == 8
    assert 0 < srv["prefix_hit_rate"] <= srv["ideal_prefix_hit_rate"] + 0.05


# ---- pagoda serve --data-parallel-size -------------------------------------------------------------------
def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _all_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.2)
    return False


API_KEY = "dp-user-key"
KEYED = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def launcher() -> Iterator[ServerProcess]:
    """`pagoda serve --data-parallel-size 2` with a key; round_robin, so that each replica's share is known."""
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router)")
    srv = ServerProcess("--data-parallel-size", "2", "--data-parallel-base-port", "0", "--api-key", API_KEY,
                        "--router-policy", "round_robin", *REPLICA_ARGS)
    try:
        srv.wait_ready()  # the front's /health: the router has a replica to send requests to
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def _launched(srv: ServerProcess) -> list[psutil.Process]:
    """The launcher's own children (the replicas' compile workers are theirs), the ones it has reaped."""
    return [p for p in psutil.Process(srv.proc.pid).children() if p.status() != psutil.STATUS_ZOMBIE]


def _flag(p: psutil.Process, flag: str) -> str:
    cmd = p.cmdline()
    return cmd[cmd.index(flag) + 1]


def _replica_procs(srv: ServerProcess) -> list[psutil.Process]:
    """The launcher's replicas, in rank order (their ports are in the order of their ranks' cores)."""
    found = [p for p in _launched(srv) if "pagoda.entrypoints.cli" in " ".join(p.cmdline())]
    return sorted(found, key=lambda p: min(p.cpu_affinity()))


def _front_proc(srv: ServerProcess) -> psutil.Process:
    (p,) = [p for p in _launched(srv) if "pagoda.entrypoints.server.front" in " ".join(p.cmdline())]
    return p


def _url_counters(urls: list[str]) -> list[dict[str, float]]:
    return [server_counters(httpx.get(f"{u}/metrics", timeout=10).text) for u in urls]


@needs_router
def test_the_routers_admin_routes_are_refused_and_the_users_key_stays_in_the_front(launcher: ServerProcess) -> None:
    replica_urls = [f"http://127.0.0.1:{_flag(p, '--port')}" for p in _replica_procs(launcher)]
    victim = urllib.parse.quote(replica_urls[0], safe="")
    attempts = [("POST", "/add_worker?url=http://127.0.0.1:9"), ("POST", f"/remove_worker?url={victim}"),
                ("GET", "/list_workers"), ("GET", "/get_loads"), ("GET", "/workers"), ("POST", "/workers"),
                ("DELETE", f"/workers/{victim}"), ("POST", "//add_worker/?url=http://127.0.0.1:9"),
                ("POST", "/add%5Fworker?url=http://127.0.0.1:9")]
    for method, path in attempts:
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401), (KEYED, 403)):
            r = httpx.request(method, launcher.url + path, headers=headers, timeout=10)
            assert (r.status_code, r.json()["error"]["code"]) == (status, status), (method, path, headers, r.text)
    # Both replicas are still in the rotation: round_robin gives each one of two requests.
    before = _url_counters(replica_urls)
    client = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    for _ in range(2):
        assert ask(client, "The capital of France is").choices[0].finish_reason == "length"
    assert deltas(before, _url_counters(replica_urls), "requests") == [1, 1]
    # Behind the front nothing takes the user's key: the router on loopback refuses its admin routes to it and
    # to no key at all, and the replicas answer only the worker secret.
    router_url = _flag(_front_proc(launcher), "--router")
    for headers in ({}, KEYED):
        assert httpx.post(f"{router_url}/add_worker?url=http://127.0.0.1:9", headers=headers).status_code == 401
        assert httpx.get(f"{router_url}/list_workers", headers=headers).status_code == 401
        for url in replica_urls:
            assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
    # The key is on no child's command line, and in no environment but the front's.
    kids = _launched(launcher)
    assert len(kids) == 4, [p.cmdline() for p in kids]  # two replicas, the router, the front
    assert not any(API_KEY in " ".join(p.cmdline()) for p in kids)
    assert [p.pid for p in kids if p.environ().get("PAGODA_API_KEY") == API_KEY] == [_front_proc(launcher).pid]
    secret = _replica_procs(launcher)[0].environ()["PAGODA_API_KEY"]
    workers = httpx.get(f"{router_url}/list_workers", headers={"Authorization": f"Bearer {secret}"}).json()
    assert sorted(workers["urls"]) == sorted(replica_urls)  # nobody added or removed one


@needs_router
def test_tokenize_detokenize_and_flush_cache_answer_through_the_front(launcher: ServerProcess) -> None:
    prompt = "The capital of France is"
    tokens = httpx.post(f"{launcher.url}/tokenize", json={"prompt": prompt}, headers=KEYED, timeout=30)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = httpx.post(f"{launcher.url}/detokenize", json={"tokens": ids}, headers=KEYED, timeout=30)
    assert (text.status_code, text.json()["prompt"]) == (200, prompt)
    for route in ("/tokenize", "/detokenize", "/flush_cache"):
        assert httpx.post(f"{launcher.url}{route}", json={"prompt": prompt}).status_code == 401
    # /flush_cache and /reset_prefix_cache empty every replica's prefix cache, not one.
    replica_urls = [f"http://127.0.0.1:{_flag(p, '--port')}" for p in _replica_procs(launcher)]
    client = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    shared = prefixes(1, 60, offset=30)[0]
    for route in ("/flush_cache", "/reset_prefix_cache"):
        for _ in range(2):  # round_robin: once on each replica, which caches the prefix
            ask(client, shared + "Summary:")
        flushed = httpx.post(f"{launcher.url}{route}", headers=KEYED, timeout=30)
        assert flushed.status_code == 200, flushed.text
        before = _url_counters(replica_urls)
        for _ in range(2):
            ask(client, shared + "Summary:")
        assert deltas(before, _url_counters(replica_urls), "prefix_cache_hits") == [0, 0], route


def _aborted(urls: list[str]) -> float:
    """Requests the replicas finished as aborted."""
    return sum(s.value for u in urls for f in text_string_to_metric_families(httpx.get(f"{u}/metrics").text)
               for s in f.samples
               if s.name == "pagoda:request_success_total" and s.labels.get("finished_reason") == "abort")


@needs_router
def test_a_client_that_leaves_the_front_stops_its_request_on_the_replica(launcher: ServerProcess) -> None:
    urls = [f"http://127.0.0.1:{_flag(p, '--port')}" for p in _replica_procs(launcher)]
    # Long enough (about 500 tokens) that only an abort ends it within the deadline below.
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True}

    def settled(before: float) -> None:
        deadline = time.monotonic() + 5
        while sum(samples(u)["pagoda:num_requests_running"] for u in urls) or _aborted(urls) == before:
            assert time.monotonic() < deadline, "the replica went on generating for a client that left"
            time.sleep(0.1)

    before = _aborted(urls)
    with httpx.stream("POST", f"{launcher.url}/v1/completions", json={**body, "stream": True}, headers=KEYED,
                      timeout=60) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    settled(before)
    before = _aborted(urls)
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming request: the client leaves before any answer
        httpx.post(f"{launcher.url}/v1/completions", json=body, headers=KEYED, timeout=1.5)
    settled(before)


@needs_router
def test_a_killed_replica_is_restarted_and_its_cut_stream_ends_with_an_error_event(launcher: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    procs = _replica_procs(launcher)
    urls = [f"http://127.0.0.1:{_flag(p, '--port')}" for p in procs]
    stream = iter(client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=400,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    for _ in range(2):
        next(stream)
    running = [samples(u)["pagoda:num_requests_running"] for u in urls]
    victim = running.index(1.0)
    cores = procs[victim].cpu_affinity()
    procs[victim].kill()
    with pytest.raises(openai.APIError, match="replica serving this request stopped"):
        for _ in stream:
            pass
    # The other replica serves meanwhile.
    assert ask(client, "Hello").choices[0].finish_reason == "length"
    deadline = time.monotonic() + 120
    while f"replica {victim} is healthy again and back in the router" not in launcher.log_tail(20000):
        assert time.monotonic() < deadline, launcher.log_tail()
        time.sleep(0.2)
    (again,) = [p for p in _replica_procs(launcher) if _flag(p, "--port") == urls[victim].rsplit(":", 1)[1]]
    assert again.pid != procs[victim].pid and again.cpu_affinity() == cores
    before = _url_counters(urls)
    for _ in range(2):
        assert ask(client, "Hello").choices[0].finish_reason == "length"
    assert deltas(before, _url_counters(urls), "requests") == [1, 1]


@needs_router
def test_serve_data_parallel_size_2_serves_through_the_front_and_stops_everything(launcher: ServerProcess) -> None:
    kids = _children(launcher.proc)
    replicas = _replica_procs(launcher)
    assert len(replicas) == 2 and len(_launched(launcher)) == 4, [p.cmdline() for p in kids]
    cores = [set(p.cpu_affinity()) for p in replicas]
    assert not cores[0] & cores[1] and len(cores[0] | cores[1]) == min(2, len(data_parallel.usable_cores()))
    assert [p.environ()["OMP_NUM_THREADS"] for p in replicas] == [str(len(c)) for c in cores]
    client = openai.OpenAI(base_url=f"{launcher.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].message.content
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0, launcher.log_tail()
    assert _all_gone([p.pid for p in kids], 10), "children left behind"


@needs_router
def test_killing_the_launcher_takes_its_replicas_with_it() -> None:
    srv = ServerProcess("--data-parallel-size", "2", "--data-parallel-base-port", "0", *REPLICA_ARGS)
    try:
        deadline = time.monotonic() + 60
        while len(kids := _children(srv.proc)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(kids) >= 2, srv.log_tail()
        srv.proc.kill()  # no handler runs: only the kernel's parent-death signal stops the children
        srv.proc.wait(10)
        assert _all_gone([p.pid for p in kids], 30), "orphaned replicas"
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def test_data_parallel_flags_are_checked_before_anything_starts(capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ncores = len(data_parallel.usable_cores())
    assert cli_main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err
    assert cli_main(["serve", "--data-parallel-size", str(ncores + 1)]) == 2
    assert f"may use {ncores}" in capsys.readouterr().err
    if ncores >= 2:  # without the router installed: the error says how to install it
        monkeypatch.setitem(sys.modules, "vllm_router", None)  # what find_spec reads as not installed
        assert cli_main(["serve", "--data-parallel-size", "2"]) == 2
        assert "pip install vllm-router" in capsys.readouterr().err


def test_replicas_get_every_serve_flag_but_the_launchers() -> None:
    from pagoda.entrypoints.cli import build_parser

    argv = ["serve", "model.gguf", "--data-parallel-size", "2", "--port", "9000", "--router-policy", "round_robin",
            "--max-num-seqs", "8", "--no-enable-prefix-caching", "--served-model-name", "a", "b", "-q", "int8",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--access-log",
            "--drain-timeout", "5", "--api-key", "user-key"]
    args = build_parser().parse_args(argv)
    forwarded = data_parallel.forwarded_args(args)
    assert "--port" not in forwarded and "--data-parallel-size" not in forwarded and "--router-policy" not in forwarded
    assert "--api-key" not in forwarded and "user-key" not in forwarded  # the replicas get the worker secret
    again = build_parser().parse_args(["serve", *forwarded])
    for key in ("model", "max_num_seqs", "enable_prefix_caching", "served_model_name", "quantization",
                "speculative_config", "access_log", "drain_timeout"):
        assert getattr(again, key) == getattr(args, key), key
    assert again.data_parallel_size == 1 and again.port == 8000


def test_a_replica_is_restarted_at_most_five_times_in_ten_minutes() -> None:
    policy = data_parallel.RestartPolicy()
    restarts = [0.0, 60.0, 120.0, 180.0]
    assert policy.allows(restarts, 240.0)
    assert not policy.allows(restarts + [240.0], 300.0)
    assert policy.allows(restarts + [240.0], 601.0)  # the first restart has left the window


def test_a_replica_that_keeps_dying_is_restarted_then_left_down(capsys: pytest.CaptureFixture) -> None:
    def child(name: str, code: str) -> data_parallel.Child:
        return data_parallel.Child(name, [sys.executable, "-c", code], "http://127.0.0.1:9")

    dying = child("replica 0", "raise SystemExit(3)")
    router, front_ = child("router", "import time; time.sleep(60)"), child("front", "import time; time.sleep(60)")
    server = data_parallel.DataParallelServer([dying], router, front_, "secret", drain_timeout=1.0,
                                              restart=data_parallel.RestartPolicy(max_restarts=2, window_s=600.0))
    try:
        for c in (router, front_, dying):
            server._start(c, signal.SIGKILL)
        assert server._watch() == 1  # no replica left
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert err.count("restarting replica 0") == 2 and "replica 0 exited 3 times within 600 s; it stays down" in err
    assert dying.proc is None and len(dying.restarts) == 2


class _CutStream(httpx.AsyncByteStream):
    """A replica's event stream that stops halfway through its second event: the process died."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "Once"}]}\n\n'
        yield b'data: {"choices": [{"te'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_the_front_checks_the_key_swaps_it_for_the_secret_and_ends_a_cut_stream_with_an_error_event() -> None:
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/flush_cache" and request.url.port == 2:
            raise httpx.ConnectError("refused")  # a replica that is down has nothing cached
        if request.url.path == "/v1/completions":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_CutStream())
        return httpx.Response(200)

    config = front.FrontConfig("http://127.0.0.1:9", ("http://127.0.0.1:1", "http://127.0.0.1:2"), "secret")
    app = front.build_app(config, API_KEY, httpx.AsyncClient(transport=httpx.MockTransport(upstream)))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as c:
            return [await c.post("/v1/completions", json={"stream": True}),
                    await c.post("/v1/completions", headers=KEYED, json={"stream": True}),
                    await c.post("/add_worker?url=http://evil", headers=KEYED),
                    await c.post("/flush_cache", headers=KEYED)]

    no_key, cut, admin, flushed = asyncio.run(run())
    # However a path spells an admin route, the front sees the route the router would get.
    assert [front.route_of(p) for p in ("//add_worker/", "/v1/../add_worker", "/./workers/x/..")] == [
        "/add_worker", "/add_worker", "/workers"]
    assert no_key.status_code == 401 and admin.status_code == 403 and flushed.status_code == 200
    events = [e for e in cut.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices": [{"text": "Once"}]}'  # the broken half event is dropped
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == 503
    assert events[2:] == ["data: [DONE]"]
    assert [(r.url.path, r.headers["authorization"]) for r in seen] == [
        ("/v1/completions", "Bearer secret"), ("/flush_cache", "Bearer secret"), ("/flush_cache", "Bearer secret")]
    assert sorted(r.url.port for r in seen[1:]) == [1, 2]


def test_split_cores_is_disjoint_and_even() -> None:
    assert data_parallel.split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert data_parallel.split_cores([4, 5], 2) == [[4], [5]]
    with pytest.raises(ValueError):
        data_parallel.split_cores([0, 1], 3)


def test_numa_nodes_are_read_from_sysfs(tmp_path: Path) -> None:
    # Two sockets whose hyperthreads are numbered after all the physical cores, as Linux numbers them.
    for node, cpus in (("node0", "0-3,8-11"), ("node1", "4-7,12-15")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    node = data_parallel.numa_node_of_core(tmp_path)
    assert [node[c] for c in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    groups = data_parallel.split_cores(sorted(range(16), key=lambda c: (node[c], c)), 2)
    assert [{node[c] for c in g} for g in groups] == [{0}, {1}]


# ---- last: it kills a replica of the module's pair -------------------------------------------------------
@needs_router
def test_killing_a_replica_loses_only_its_in_flight_requests(replicas: list[ServerProcess], router: RouterProcess,
                                                             client: openai.OpenAI) -> None:
    groups = prefixes(4, 100, offset=10)
    seed(client, groups)
    owner = owners(replicas, groups)
    assert set(owner) == {0, 1}, owner
    victim = 1
    tokens = 64

    results: list[dict[str, Any]] = [{"group": g, "chunks": 0, "tokens": 0, "finish": None, "error": None}
                                     for g in range(len(groups)) for _ in range(3)]

    def stream(i: int) -> None:
        result = results[i]
        try:
            for chunk in client.completions.create(
                    model=MODEL_NAME, prompt=f"{groups[result['group']]}Question {i}:", max_tokens=tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if chunk.choices:
                    result["chunks"] += 1
                    result["finish"] = chunk.choices[0].finish_reason or result["finish"]
                if chunk.usage:
                    result["tokens"] = chunk.usage.completion_tokens
        except (openai.APIError, httpx.HTTPError) as e:
            result["error"] = repr(e)

    with cf.ThreadPoolExecutor(len(results)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(results))]
        deadline = time.monotonic() + 60
        # Kill the victim once its streams are under way.
        while not any(r["chunks"] >= 2 for r in results if owner[r["group"]] == victim):
            assert time.monotonic() < deadline, "the victim never streamed"
            time.sleep(0.02)
        replicas[victim].proc.kill()
        for f in futures:
            f.result(timeout=120)
    ok = [r["finish"] == "length" and r["tokens"] == tokens and r["error"] is None for r in results]
    lost = [r for r, good in zip(results, ok) if not good]
    assert lost, "no request was in flight on the killed replica"
    assert all(owner[r["group"]] == victim for r in lost), lost
    # The router keeps serving, the victim's groups included (its circuit breaker or health check moves them).
    for prefix in groups:
        assert ask(client, prefix + "Title:", max_tokens=4).choices[0].finish_reason == "length"
