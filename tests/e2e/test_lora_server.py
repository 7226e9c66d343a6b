"""LoRA adapters through the server: chosen by the `model` field with the official `openai` client, listed by
/v1/models with their parent, loaded and unloaded at runtime, and a corrupt adapter refused by name alone."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import ServerProcess

pytest.importorskip("peft")
from tiny_models import build_tiny_model, save_byte_tokenizer  # noqa: E402

from tests.test_lora import ADAPTERS, make_adapter  # noqa: E402

KEY = "lora-test-key"
PROMPT = "ab"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_server")
    model = build_tiny_model(root / "model", "llama")
    save_byte_tokenizer(model)
    out = {"model": model}
    for i, name in enumerate(["all", "qv"]):
        out[name] = Path(make_adapter(str(model), root / name, *ADAPTERS[name], seed=i + 1))
    corrupt = root / "corrupt"
    shutil.copytree(out["all"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    out["corrupt"] = corrupt
    return out


@pytest.fixture(scope="module")
def expected(folders) -> dict[str | None, list[int]]:
    """The offline engine's greedy tokens for each adapter (tests/test_lora.py pins those to peft's)."""
    from pagoda import LLM, SamplingParams
    from pagoda.lora import LoRARequest

    llm = LLM(str(folders["model"]), dtype="float32", enable_lora=True, max_lora_rank=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out: dict[str | None, list[int]] = {}
    for i, name in enumerate([None, "all", "qv"]):
        lora = LoRARequest(name, i, str(folders[name])) if name else None
        out[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    return out


@pytest.fixture(scope="module")
def server(folders) -> Iterator[ServerProcess]:
    with ServerProcess(str(folders["model"]), "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "16", "--lora-modules", f"all={folders['all']}", "--api-key", KEY,
                       "--kv-cache-memory", "16MiB") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai(KEY, 60)


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _post(server: ServerProcess, route: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_model_field_selects_the_adapter(client, expected) -> None:
    assert expected["all"] != expected[None]
    assert _complete(client, "all") == expected["all"]
    assert _complete(client, "base") == expected[None]


def test_models_lists_adapters_with_their_parent(client, folders) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert cards["all"].parent == "base" and cards["all"].root == str(folders["all"])
    assert getattr(cards["base"], "parent", None) is None


def test_load_and_unload_routes(server, client, folders, expected) -> None:
    assert _post(server, "load_lora_adapter", {"lora_name": "qv", "lora_path": str(folders["qv"])}, key=None) \
        .status_code == 401
    r = _post(server, "load_lora_adapter", {"lora_name": "qv", "lora_path": str(folders["qv"])})
    assert r.status_code == 200, r.text
    assert _complete(client, "qv") == expected["qv"]
    assert _post(server, "load_lora_adapter", {"lora_name": "qv", "lora_path": str(folders["qv"])}) \
        .status_code == 400  # already loaded
    assert _post(server, "unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "qv")
    assert _post(server, "unload_lora_adapter", {"lora_name": "qv"}).status_code == 404


def test_a_corrupt_adapter_is_a_400_for_its_name_alone(server, client, folders, expected) -> None:
    r = _post(server, "load_lora_adapter", {"lora_name": "broken", "lora_path": str(folders["corrupt"])})
    assert r.status_code == 400
    assert "'broken'" in r.json()["error"]["message"]
    assert "broken" not in {m.id for m in client.models.list().data}
    assert _complete(client, "all") == expected["all"]  # the others go on
