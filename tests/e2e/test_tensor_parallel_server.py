"""`pagoda serve --tensor-parallel-size 2` through the official openai client: the answers of a one-process server,
and a rank that dies turns the server into 503s, not a hang."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from pagoda import LLM, SamplingParams
from tests.e2e.conftest import MODEL_NAME, ServerProcess, free_port

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
STEP_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def tp_server() -> Iterator[ServerProcess]:
    with ServerProcess("--tensor-parallel-size", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                       "--served-model-name", MODEL_NAME, "--step-timeout", str(STEP_TIMEOUT)) as srv:
        yield srv


def test_chat_and_stream_equal_one_process(tp_server: ServerProcess, default_gguf: str) -> None:
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    client = tp_server.openai("none")
    reply = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == want
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=16,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


@pytest.mark.long
def test_a_stopped_rank_makes_health_503_until_it_resumes(tp_server: ServerProcess) -> None:
    """SIGSTOP on rank 1 mid-stream: /health turns 503 once a step has run past --step-timeout, and 200 again
    after SIGCONT, when the stream finishes with every token."""
    rank1 = max(psutil.Process(tp_server.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
    client = tp_server.openai("none")
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=64, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + STEP_TIMEOUT + 10
        while httpx.get(f"{tp_server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 with a stopped rank"
            time.sleep(0.2)
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[0].completion_tokens == 64
    assert httpx.get(f"{tp_server.url}/health", timeout=5).status_code == 200


def test_a_dead_rank_turns_the_server_into_503s(tp_server: ServerProcess) -> None:
    """Runs last in this module: the server is dead afterwards."""
    children = psutil.Process(tp_server.proc.pid).children(recursive=True)
    victim = max(children, key=lambda p: p.memory_info().rss)  # rank 1 holds weights; multiprocessing's helper not
    os.kill(victim.pid, signal.SIGKILL)
    client = tp_server.openai("none", timeout=30)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8)
    assert err.value.status_code in (500, 503), tp_server.log_tail(20000)
    assert time.monotonic() - t0 < 15
    deadline = time.monotonic() + 10
    while httpx.get(f"{tp_server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, f"/health still answers 200 after a rank died:\n{tp_server.log_tail(20000)}"
        time.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=8)
    assert err.value.status_code == 503


@pytest.mark.long
def test_torchrun_ranks_serve_over_loopback() -> None:
    """The multi-host launch, on one host: torchrun starts both ranks with the same command; rank 0 serves, rank 1
    runs its shard, and their collectives go through torch.distributed (gloo) on 127.0.0.1."""
    torchrun = ("-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(free_port()))
    srv = ServerProcess("--tensor-parallel-size", "2", "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                        "--served-model-name", MODEL_NAME, launcher=torchrun)
    try:
        srv.wait_ready()
        client = srv.openai("none")
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
        want = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12),
                            use_tqdm=False)[0].outputs[0].text
        got = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", temperature=0,
                                        max_tokens=12)
        assert got.choices[0].text == want
        assert "torch.distributed" in srv.log_tail(20000)
    finally:
        assert srv.stop() is not None
        os.unlink(srv.log.name)
