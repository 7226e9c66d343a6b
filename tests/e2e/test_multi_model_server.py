"""Several models in one `pagoda serve` (--model twice, --models-dir): routing by the `model` field, /v1/models
with states, load and unload by hand and under load, a model that fails to load, and a memory budget."""
from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from tiny_models import build_tiny_model, save_byte_tokenizer

from tests.e2e.conftest import ServerProcess

PROMPT = "The quick brown fox"
LONG_TOKENS = 300  # long enough that an unload asked for after the first token finds the requests in flight
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def tiny_model(folder: Path, arch: str, **overrides) -> str:
    build_tiny_model(folder, arch, **overrides)
    save_byte_tokenizer(folder, CHAT_TEMPLATE)
    return str(folder)


def greedy_text(model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    from pagoda import LLM, SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_memory="8MiB", max_model_len=512)
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))
    return out[0].outputs[0].text


def states(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"] for m in data}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """alpha (Llama) and beta (Qwen2), and `broken`: a config.json beside a weight file that is not safetensors."""
    root = tmp_path_factory.mktemp("models")
    tiny_model(root / "alpha", "llama")
    tiny_model(root / "beta", "qwen2", tie_word_embeddings=True)
    (root / "broken").mkdir()
    shutil.copy(root / "alpha" / "config.json", root / "broken" / "config.json")
    save_byte_tokenizer(root / "broken", CHAT_TEMPLATE)
    (root / "broken" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors file")
    return root


@pytest.fixture(scope="module")
def reference(models_dir: Path) -> dict[str, str]:
    """Each model's greedy text served alone, offline."""
    return {name: greedy_text(str(models_dir / name), PROMPT, 12) for name in ("alpha", "beta")}


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("--models-dir", str(models_dir), "--kv-cache-memory", "8MiB", "--max-model-len", "512",
                       "--max-num-seqs", "16") as srv:
        yield srv


def test_models_list_every_model_unloaded_until_its_first_request(server: ServerProcess) -> None:
    body = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["alpha", "beta", "broken"]
    assert all(m["object"] == "model" and m["status"] == "unloaded" for m in body["data"])


def test_two_models_answer_each_as_itself(server: ServerProcess, reference: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    for name in ("alpha", "beta"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0.0)
        assert out.model == name
        assert out.choices[0].text == reference[name], name
    assert reference["alpha"] != reference["beta"]
    assert states(server.url) == {"alpha": "loaded", "beta": "loaded", "broken": "unloaded"}
    # No model named: the first one.
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference["alpha"]
    chat = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "beta"


def test_unknown_model_is_a_404_in_openai_shape(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
    assert "gamma" in e.value.body["message"]  # type: ignore[index]
    r = httpx.post(f"{server.url}/models/load", json={"model": "gamma"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_a_model_that_fails_to_load_fails_alone(server: ServerProcess, reference: dict[str, str]) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "broken", "prompt": PROMPT, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "broken" in message and "failed to load" in message
    card = next(m for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"] if m["id"] == "broken")
    assert card["status"] == "failed" and "broken" in card["error"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0.0)
    assert out.choices[0].text == reference["alpha"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_metrics_carry_each_models_label_once_per_family(server: ServerProcess) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'pagoda:generation_tokens_total{model_name="alpha"}' in text
    assert 'pagoda:generation_tokens_total{model_name="beta"}' in text
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))


def test_unload_and_reload_under_load_lose_no_request(server: ServerProcess, models_dir: Path) -> None:
    expected = greedy_text(str(models_dir / "beta"), PROMPT, LONG_TOKENS, ignore_eos=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    started = threading.Barrier(9, timeout=120)
    results: list[tuple[str, int | None]] = []
    errors: list[BaseException] = []

    def one_stream() -> None:
        try:
            stream = client.completions.create(model="beta", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0.0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            text, usage, first = "", None, True
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if first:
                    first = False
                    started.wait()
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            results.append((text, usage))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            started.abort()

    def one_late() -> None:
        try:
            out = client.completions.create(model="beta", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            results.append((out.choices[0].text, out.usage.completion_tokens if out.usage else None))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one_stream) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token
    refused = httpx.post(f"{server.url}/models/unload", json={"model": "beta", "wait": False}, timeout=30)
    assert refused.status_code == 409, refused.text
    unloading = threading.Thread(target=lambda: results.append(
        ("unload", httpx.post(f"{server.url}/models/unload", json={"model": "beta"}, timeout=120).status_code)))
    unloading.start()
    deadline = time.monotonic() + 30
    while states(server.url)["beta"] == "loaded" and time.monotonic() < deadline:
        time.sleep(0.01)
    late = [threading.Thread(target=one_late) for _ in range(2)]  # arrive while beta unloads: served once reloaded
    for t in late:
        t.start()
    for t in (*threads, unloading, *late):
        t.join(180)
    assert not errors, errors
    assert ("unload", 200) in results
    answers = [r for r in results if r[0] != "unload"]
    assert len(answers) == 10
    assert all(text == expected and n == LONG_TOKENS for text, n in answers)
    assert states(server.url)["beta"] == "loaded"  # the late requests loaded it again
    r = httpx.post(f"{server.url}/models/unload", json={"model": "beta"}, timeout=60)
    assert r.status_code == 200 and states(server.url)["beta"] == "unloaded"
    r = httpx.post(f"{server.url}/models/load", json={"model": "beta"}, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "loaded"


# ---- a memory budget ----------------------------------------------------------------------------------
WEIGHT_MIB = 48  # each model's tied embedding: 24576 x 512 float32


@pytest.fixture(scope="module")
def three_models(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("budget")
    return [tiny_model(root / name, "llama", vocab_size=24576, hidden_size=512, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
            for name in ("one", "two", "three")]


def test_a_budget_for_two_of_three_keeps_two_resident_in_a_round_robin(three_models: list[str]) -> None:
    # Each model holds its weights (48 MiB) and an 8 MiB KV pool: 150 MiB fits two of them, not three.
    args = [a for path in three_models for a in ("--model", path)]
    srv = ServerProcess(*args, "--models-memory", "150MiB", "--kv-cache-memory", "8MiB", "--max-model-len", "256")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        proc = psutil.Process(srv.proc.pid)
        rss_two = None
        for i, name in enumerate(["one", "two", "three"] * 3):
            client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
            now = states(srv.url)
            assert now[name] == "loaded"
            assert sum(s == "loaded" for s in now.values()) <= 2, now
            if i == 1:
                rss_two = proc.memory_info().rss
        assert rss_two is not None
        # Seven unloads later the process holds no more than two models' worth: every unload gave memory back.
        assert proc.memory_info().rss - rss_two < WEIGHT_MIB * 2**20, (proc.memory_info().rss, rss_two)
    finally:
        srv.stop()
        os.unlink(srv.log.name)
