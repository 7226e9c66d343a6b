"""One server, two models: `pagoda serve` (the embedded SmolLM2) with `--embedding-model default` (the embedded
all-MiniLM-L6-v2) answers chat and embeddings through the official openai client, lists both in /v1/models,
and documents the pooling routes in its OpenAPI document."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

# A server of its own for one feature (the fuzz server also runs chat beside embeddings): kept out of the
# default run to hold its time.
pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    from pagoda.model.default_model import default_embedding_model_path, default_model_path

    try:
        default_model_path()
        default_embedding_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with ServerProcess("--kv-cache-memory", "128MiB", "--max-model-len", "512", "--max-num-seqs", "4",
                       "--embedding-model", "default", "--max-queue-delay-ms", "1") as srv:
        yield srv


def test_one_server_answers_chat_and_embeddings_through_the_openai_client(server: ServerProcess) -> None:
    client = server.openai()
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == MODEL_NAME and chat.choices[0].message.content and chat.usage.completion_tokens <= 4
    emb = client.embeddings.create(model=EMBEDDING_MODEL, input=["hello world", "a cat sits"])  # SDK: base64
    assert emb.model == EMBEDDING_MODEL and [len(d.embedding) for d in emb.data] == [384, 384]
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL_NAME, EMBEDDING_MODEL}
    assert listed[EMBEDDING_MODEL].model_extra["max_model_len"] == 256


def test_each_model_answers_only_its_own_routes(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL_NAME, "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": EMBEDDING_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 404, r.text


def test_the_openapi_document_has_the_pooling_routes(server: ServerProcess) -> None:
    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/embeddings", "/score", "/rerank", "/v1/rerank", "/v2/rerank", "/embed"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "413"} <= set(responses) and "422" not in responses, path
    assert "404" in doc["paths"]["/v1/embeddings"]["post"]["responses"]
    assert doc["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] \
        == {"$ref": "#/components/schemas/EmbeddingResponse"}
