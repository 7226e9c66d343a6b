"""End-to-end tests of `pagoda serve` driven by the official openai client (plus raw HTTP where the
wire format itself is under test). One real server per module; a model-free fake engine covers the
paths a real model cannot trigger on demand (step failures, auth, back-pressure)."""
from __future__ import annotations

import asyncio
import gc
import json
import signal
import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.stats import EngineStats
from pagoda.kernels.policy import KernelPolicy
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from tests.e2e.conftest import ServerProcess

MODEL_NAME = "SmolLM2-135M-Instruct"
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(server_process: ServerProcess) -> dict[str, Any]:
    """Greedy outputs from the offline LLM, computed in this process while the server boots."""
    from pagoda import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    chat = llm.chat(CHAT, greedy, use_tqdm=False)[0]
    ref = {
        "completions": {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)},
        "completion_tokens": {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)},
        "prompt_tokens": {p: len(o.prompt_token_ids) for p, o in zip(PROMPTS, outs)},
        "chat": chat.outputs[0].text,
        "chat_prompt_tokens": len(chat.prompt_token_ids),
    }
    del llm, outs, chat
    gc.collect()
    return ref


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics, summed over labels (one model is served)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def wait_for(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def sse_lines(server: ServerProcess, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


# ---- basics --------------------------------------------------------------------------------------
def test_models_health_version(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()
    assert "version" in version
    # The kernel set in use, as the start-up log says it
    assert version["cpu_kernels"] == KernelPolicy.resolve().kernel_set != "torch fallback"
    assert version["cpu_kernels_build"] == KernelPolicy.resolve().kernel_build != "none"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_greedy_equals_llm(client: openai.OpenAI, reference: dict) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.object == "text_completion"
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    for prompt, choice in zip(PROMPTS, resp.choices):
        assert choice.text == reference["completions"][prompt]
        assert choice.finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens == sum(reference["prompt_tokens"].values())
    assert resp.usage.completion_tokens == sum(len(t) for t in reference["completion_tokens"].values())
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_token_id_prompt(server: ServerProcess, client: openai.OpenAI, reference: dict) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].text == reference["completions"][PROMPTS[0]]


def test_completion_stream_with_usage(server: ServerProcess, client: openai.OpenAI, reference: dict) -> None:
    prompt = PROMPTS[1]
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["completions"][prompt]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(reference["completion_tokens"][prompt])
    assert all(c.usage is None for c in chunks[:-1])
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("length", "stop")
    # The wire format itself: data: {...} events, then data: [DONE].
    lines = sse_lines(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "stream": True})
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_chat_greedy_and_stream(client: openai.OpenAI, reference: dict) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == reference["chat"]
    assert resp.usage.prompt_tokens == reference["chat_prompt_tokens"]
    # max_completion_tokens is an alias of max_tokens.
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]
    assert chunks[-1].usage.prompt_tokens == reference["chat_prompt_tokens"]


def test_n_greater_than_one(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=8, temperature=1.0,
                                     n=3, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens <= 3 * 8
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, n=2, seed=1,
                                          stream=True)
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in chat:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(texts.values())


def test_stop_strings(client: openai.OpenAI, reference: dict) -> None:
    prompt = PROMPTS[0]
    full = reference["completions"][prompt]
    stop = full[len(full) // 2: len(full) // 2 + 2]  # two characters from the middle of the known output
    expected = full[: full.find(stop)]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     stop=[stop])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    # Streaming must not leak any part of the stop string before it is known to be one.
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                     logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for _tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert x == pytest.approx(max(top.values()), abs=1e-4)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)


def test_echo(client: openai.OpenAI, reference: dict) -> None:
    prompt = PROMPTS[1]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                     logprobs=1)
    assert resp.choices[0].text.startswith(prompt)
    assert resp.choices[0].text[len(prompt):] == reference["completions"][prompt][: len(resp.choices[0].text)
                                                                                   - len(prompt)]
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert len(lp.tokens) == reference["prompt_tokens"][prompt] + 4


def test_tokenize_detokenize(server: ServerProcess, reference: dict) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[2]}).json()
    assert r["count"] == len(r["tokens"]) == reference["prompt_tokens"][PROMPTS[2]]
    assert r["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[2]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == reference["chat_prompt_tokens"]


# ---- concurrency and disconnects -----------------------------------------------------------------
def test_16_concurrent_streams(server: ServerProcess, reference: dict) -> None:
    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(16)))

    before = metrics(server)["pagoda:request_success_total"]
    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        assert text == reference["completions"][PROMPTS[i % len(PROMPTS)]], f"client {i}"
    assert metrics(server)["pagoda:request_success_total"] - before == 16


def test_disconnect_frees_blocks(server: ServerProcess) -> None:
    wait_for(lambda: metrics(server)["pagoda:num_requests_running"] == 0, what="an idle server")
    idle = metrics(server)
    body = {"model": MODEL_NAME, "prompt": PROMPTS[3], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection early
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        busy = metrics(server)
        assert busy["pagoda:num_requests_running"] == 1
        assert busy["pagoda:num_free_kv_blocks"] < idle["pagoda:num_free_kv_blocks"]
    # Leaving the block closes the connection mid-stream.
    wait_for(lambda: metrics(server)["pagoda:num_requests_running"] == 0, what="the abort")
    after = metrics(server)
    assert after["pagoda:num_free_kv_blocks"] == idle["pagoda:num_free_kv_blocks"]
    assert after["pagoda:kv_cache_usage_perc"] == pytest.approx(idle["pagoda:kv_cache_usage_perc"])
    assert after["pagoda:generation_tokens_total"] - idle["pagoda:generation_tokens_total"] < 400


# ---- bad input ------------------------------------------------------------------------------------
_LONG_PROMPT = "hello " * 600  # > --max-model-len 512 tokens

BAD_INPUTS = [
    ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', 400),
    ("wrong type", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "many"}, 400),
    ("wrong type chat", "/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, 400),
    ("missing prompt", "/v1/completions", {"model": MODEL_NAME}, 400),
    ("max_tokens beyond context", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10_000}, 400),
    ("prompt beyond context", "/v1/completions", {"model": MODEL_NAME, "prompt": _LONG_PROMPT, "max_tokens": 1}, 400),
    ("negative temperature", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -0.5}, 400),
    ("negative temperature chat", "/v1/chat/completions",
     {"model": MODEL_NAME, "messages": CHAT, "temperature": -1}, 400),
    ("empty prompt", "/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400),
    ("empty prompt list", "/v1/completions", {"model": MODEL_NAME, "prompt": []}, 400),
    ("empty messages", "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
    ("bad top_p", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404),
    ("unknown model chat", "/v1/chat/completions", {"model": "gpt-17", "messages": CHAT}, 404),
    ("unknown route", "/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(server: ServerProcess, name: str, path: str, body: Any, status: int) -> None:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{server.url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_input_through_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices


def test_metrics_parse_and_move(server: ServerProcess, client: openai.OpenAI) -> None:
    before = metrics(server)
    for name in ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
                 "pagoda:prompt_tokens_total", "pagoda:generation_tokens_total", "pagoda:num_preemptions_total",
                 "pagoda:time_to_first_token_seconds_count", "pagoda:time_per_output_token_seconds_count",
                 "pagoda:e2e_request_latency_seconds_count", "pagoda:request_queue_time_seconds_count",
                 "pagoda:iteration_tokens_total_count", "pagoda:engine_step_seconds_count",
                 "pagoda:model_forward_seconds_count"):
        assert name in before, name
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["pagoda:prompt_tokens_total"] - before["pagoda:prompt_tokens_total"] == resp.usage.prompt_tokens
    assert after["pagoda:generation_tokens_total"] - before["pagoda:generation_tokens_total"] == 5
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert after[f"pagoda:{name}_count"] == before[f"pagoda:{name}_count"] + 1, name
    # One step computes the prompt (less what the prefix cache holds) and samples token 1; four decode steps follow.
    # (The engine publishes a step's figures just after handing out its tokens.)
    steps = "pagoda:engine_step_seconds_count"
    wait_for(lambda: metrics(server)[steps] >= before[steps] + 5, what="the last step's metrics")
    after = metrics(server)
    delta = {k: after[k] - before[k] for k in after if k.startswith(("pagoda:iteration", "pagoda:engine_step",
                                                                      "pagoda:model_forward"))}
    assert delta["pagoda:iteration_tokens_total_count"] == delta["pagoda:engine_step_seconds_count"] == 5
    assert 5 <= delta["pagoda:iteration_tokens_total_sum"] <= resp.usage.prompt_tokens + 4
    assert delta["pagoda:engine_step_seconds_sum"] >= delta["pagoda:model_forward_seconds_sum"] > 0


def test_prefix_cache_hits_show_on_metrics_and_reset_route_works(server: ServerProcess,
                                                                  client: openai.OpenAI) -> None:
    prompt = list(range(1000, 1100))  # 100 token ids: 6 full blocks of 16
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).raise_for_status()
    before = metrics(server)
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    mid = metrics(server)
    assert mid["pagoda:prefix_cache_queries_total"] - before["pagoda:prefix_cache_queries_total"] == 200
    assert mid["pagoda:prefix_cache_hits_total"] - before["pagoda:prefix_cache_hits_total"] == 96
    # Another tenant's salt and a reset cache both miss.
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "other"})
    assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).status_code == 200
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    after = metrics(server)
    assert after["pagoda:prefix_cache_hits_total"] == mid["pagoda:prefix_cache_hits_total"]


# Keep last: it stops the module's server.
def test_sigterm_drains_and_exits_zero(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    lines = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 1:
                server.proc.send_signal(signal.SIGTERM)
    # The in-flight request finished (drained), not cut off.
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0, server.log_tail()


# ---- model-free: a fake engine for failure injection, auth and back-pressure -----------------------
class FakeTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class FakeInputProcessor:
    vocab_size = 256

    def __init__(self, tokenizer: FakeTokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def process(self, prompt: Any, params: Any) -> Any:
        params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        return SimpleNamespace(prompt_token_ids=ids, params=params)

    def start_compile(self, params: Any) -> None:
        return None

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens)

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt))


class FakeEngine:
    """Emits 'a' once per step per request. `hold` keeps requests waiting; `fail_next` makes step() raise."""
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.input_processor = FakeInputProcessor(self.tokenizer, self.max_model_len)
        self.args = SimpleNamespace(vocab_size=256)
        self.scheduler = SimpleNamespace(waiting=deque())
        self.runner = SimpleNamespace(policy=KernelPolicy(cpp=False))
        self.requests: dict[str, dict] = {}
        self.hold = False
        self.fail_next = False
        self.priorities: list[int] = []  # of every request added

    def engine_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests) - len(self.scheduler.waiting),
                           num_waiting=len(self.scheduler.waiting), num_free_blocks=100)

    def add_processed(self, processed: Any, request_id: str, cache_salt: str | None = None,
                      client: str | None = None, priority: int = 0, lora_request: Any = None) -> Any:
        ids = processed.prompt_token_ids
        self.requests[request_id] = {"ids": ids, "out": [], "max": processed.params.max_tokens or 4,
                                     "metrics": RequestMetrics(arrival_time=time.time()), "priority": priority}
        self.priorities.append(priority)
        self.scheduler.waiting.append(request_id)
        return SimpleNamespace(prompt_token_ids=ids)

    def reset_prefix_cache(self) -> None:
        pass

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        if request_id in self.scheduler.waiting:
            self.scheduler.waiting.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) and not self.hold

    def step(self) -> list[RequestOutput]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step failure")
        self.scheduler.waiting.clear()
        outs = []
        for rid, r in list(self.requests.items()):
            r["out"].append(ord("a"))
            done = len(r["out"]) >= r["max"]
            now = time.time()
            m = r["metrics"]
            m.first_scheduled_time = m.first_scheduled_time or now
            m.first_token_time = m.first_token_time or now
            m.finished_time = now if done else None
            c = CompletionOutput(0, "a" * len(r["out"]), list(r["out"]), finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, None, r["ids"], [c], done, metrics=m))
            if done:
                del self.requests[rid]
        return outs


def _fake_app(**settings: Any) -> tuple[Any, Any, Any]:
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.entrypoints.server.app import ServerSettings, create_app
    from pagoda.entrypoints.server.metrics import ServerMetrics

    fake = FakeEngine()
    m = ServerMetrics("fake")
    engine = AsyncEngine(fake, m)  # type: ignore[arg-type]
    return create_app(engine, ServerSettings(served_model_names=["fake"], **settings), m), engine, fake


def test_every_generation_route_passes_priority_to_the_scheduler() -> None:
    from fastapi.testclient import TestClient

    app, _, fake = _fake_app()
    msg = [{"role": "user", "content": "hi"}]
    with TestClient(app) as http:
        for i, (route, body) in enumerate([
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": msg, "max_tokens": 2}),
                ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                ("/v1/messages", {"messages": msg, "max_tokens": 2})]):
            assert http.post(route, json={**body, "priority": -5 - i}).status_code == 200, route
            r = http.post(route, json={**body, "priority": 2**40})
            assert r.status_code == 400 and "priority" in r.text, route
        assert fake.priorities == [-5, -6, -7, -8]


def test_api_key_enforced() -> None:
    from fastapi.testclient import TestClient

    app, _, _ = _fake_app(api_key="sekrit")
    with TestClient(app) as http:
        assert http.get("/v1/models").status_code == 401
        r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert http.get("/health").status_code == 200  # operational routes stay open
        assert http.get("/version").status_code == 200 and http.get("/metrics").status_code == 200
        # Every route that runs the tokenizer or changes state needs the key.
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}),
                           ("/reset_prefix_cache", None)):
            assert http.post(path, json=body).status_code == 401, path
            assert http.post(path, json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200, path
        bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="fake", prompt="hi", max_tokens=2)
        good = openai.OpenAI(base_url="http://testserver/v1", api_key="sekrit", http_client=http, max_retries=0)
        assert good.completions.create(model="fake", prompt="hi", max_tokens=2).choices[0].text == "aa"


def test_a_model_is_served_as_its_base_name_and_its_path_is_accepted() -> None:
    from fastapi.testclient import TestClient

    from pagoda.entrypoints.server.args import served_names

    assert served_names("./models/smol-hf/", None) == (["smol-hf"], ["./models/smol-hf/", "./models/smol-hf"])
    assert served_names("/m/SmolLM2.Q4_1.gguf", None) == (["SmolLM2.Q4_1"], ["/m/SmolLM2.Q4_1.gguf",
                                                                            "SmolLM2.Q4_1.gguf"])
    assert served_names("./x", ["mine"]) == (["mine"], [])  # a name given is the only one
    _, aliases = served_names("./models/smol-hf", None)
    app, _, _ = _fake_app(model_aliases=aliases)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["fake"]
        for model in ("fake", *aliases):
            assert client.completions.create(model=model, prompt="hi", max_tokens=2).model == model
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="smol", prompt="hi", max_tokens=2)


def test_step_failure_fails_only_in_flight_requests() -> None:
    from fastapi.testclient import TestClient

    app, _, fake = _fake_app()
    with TestClient(app) as http:
        fake.fail_next = True
        r = http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        fake.fail_next = True
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": "fake", "messages": CHAT, "max_tokens": 3, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert json.loads(lines[-2][6:])["error"]["code"] == 500 and lines[-1] == "data: [DONE]"
        # The server keeps serving.
        r = http.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaa"
        assert http.get("/health").status_code == 200


def test_max_waiting_requests_gives_503() -> None:
    from httpx import ASGITransport, AsyncClient

    app, engine, fake = _fake_app(max_waiting_requests=2)
    fake.hold = True

    async def main() -> None:
        engine.start()
        try:
            async with AsyncClient(transport=ASGITransport(app), base_url="http://t") as http:
                body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
                waiting = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
                for _ in range(200):
                    if engine.num_waiting == 2:
                        break
                    await asyncio.sleep(0.01)
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 503 and r.headers["retry-after"]
                assert r.json()["error"]["type"] == "ServiceUnavailableError"
                fake.hold = False
                engine.abort("wake-up")  # any command wakes the idle worker
                assert [x.status_code for x in await asyncio.gather(*waiting)] == [200, 200]
        finally:
            await engine.shutdown(timeout=1)

    asyncio.run(main())


def test_generate_abort_on_close() -> None:
    """AsyncEngine.generate: closing the iterator early aborts the request in the engine."""
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.sampling_params import SamplingParams

    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]

    async def main() -> None:
        engine.start()
        gen = engine.generate("hi", SamplingParams(max_tokens=50), "r1")
        first = await gen.__anext__()
        assert first.outputs[0].text.startswith("a")
        await gen.aclose()
        for _ in range(200):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert "r1" not in fake.requests
        await engine.shutdown(timeout=1)

    asyncio.run(main())


def test_launch_builds_the_engine_on_the_thread_that_steps_it() -> None:
    """AsyncEngine.launch: the engine is built on its worker thread (so every OpenMP region of the process opens
    there), which then serves; a failed build is raised to the caller and leaves no thread behind."""
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.sampling_params import SamplingParams

    built_on = []

    def build() -> FakeEngine:
        built_on.append(threading.current_thread())
        return FakeEngine()

    engine = AsyncEngine.launch(build)  # type: ignore[arg-type]
    assert built_on[0] is not threading.main_thread() and built_on[0].name == "pagoda-engine"

    async def main() -> None:
        engine.start()  # already running: nothing more to start
        outputs = [o async for o in engine.generate("hi", SamplingParams(max_tokens=3), "r1")]
        assert outputs[-1].finished and threading.current_thread() is not built_on[0]
        assert built_on[0].is_alive()
        await engine.shutdown(timeout=1)

    asyncio.run(main())
    built_on[0].join(5)
    assert not built_on[0].is_alive()

    def broken() -> FakeEngine:
        raise RuntimeError("no weights here")

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="no weights here"):
        AsyncEngine.launch(broken)  # type: ignore[arg-type]
    assert threading.active_count() == before


def test_step_turns_run_every_engine_step_on_one_thread_in_order() -> None:
    """StepTurns: calls from several engines' threads run one at a time on one compute thread, in arrival order,
    their results and errors handed back; a build runs on a thread of its own that ends with it."""
    from pagoda.engine.step_turns import StepTurns

    turns = StepTurns()
    ran_on: list[threading.Thread] = []
    order: list[int] = []

    def call(i: int) -> int:
        ran_on.append(threading.current_thread())
        order.append(i)
        return i * i

    results: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, turns.run(lambda: call(i))))
               for i in range(8)]
    for t in threads:
        t.start()
        t.join()  # one after another: arrival order is known
    assert results == {i: i * i for i in range(8)} and order == list(range(8))
    assert len(set(ran_on)) == 1 and ran_on[0].name == "pagoda-compute"
    with pytest.raises(KeyError):
        turns.run(lambda: {}["missing"])
    assert turns.run(lambda: threading.current_thread()) is ran_on[0]  # the thread survives an error

    built_on = turns.build(threading.current_thread)
    assert built_on.name == "pagoda-build" and not built_on.is_alive()
