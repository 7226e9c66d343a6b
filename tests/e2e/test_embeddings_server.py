"""`pagoda serve --task embed` (the embedded all-MiniLM-L6-v2) through the official openai client against
sentence-transformers, the rerank/score/TEI shapes, and bad inputs answered 400 in OpenAI's shape."""
from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import ServerProcess

openai = pytest.importorskip("openai")
st = pytest.importorskip("sentence_transformers")

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 6, "a",
         "Retrieval-augmented generation runs on CPUs."]
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def reference() -> dict:
    from pagoda.model.default_model import default_embedding_model_path

    try:
        path = default_embedding_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model = st.SentenceTransformer(path, device="cpu")
    return {"model": model, "vectors": model.encode(TEXTS)}


@pytest.fixture(scope="module")
def embed_server(reference: dict) -> Iterator[ServerProcess]:
    with ServerProcess("--task", "embed", "--max-queue-delay-ms", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(embed_server: ServerProcess):  # noqa: ANN201
    return embed_server.openai()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("encoding_format", ["float", None])
def test_openai_client_embeddings_match_sentence_transformers(client, reference: dict,
                                                              encoding_format: str | None) -> None:
    """None: the SDK's default, which asks for base64 and decodes it."""
    fmt = {"encoding_format": encoding_format} if encoding_format else {}
    batched = client.embeddings.create(model=MODEL, input=TEXTS, **fmt)
    assert [d.index for d in batched.data] == list(range(len(TEXTS)))
    assert batched.usage.prompt_tokens == batched.usage.total_tokens > 0
    for d, want in zip(batched.data, reference["vectors"]):
        assert _cos(np.asarray(d.embedding, dtype=np.float32), want) >= 0.9999
    single = client.embeddings.create(model=MODEL, input=TEXTS[1], **fmt)
    assert _cos(np.asarray(single.data[0].embedding, dtype=np.float32), reference["vectors"][1]) >= 0.9999


def test_the_sdk_default_base64_is_little_endian_float32(embed_server: ServerProcess, reference: dict) -> None:
    body = httpx.post(f"{embed_server.url}/v1/embeddings",
                      json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and _cos(vec, reference["vectors"][0]) >= 0.9999


def test_token_id_input_embeds_like_its_text(client, reference: dict) -> None:
    ids = reference["model"].tokenizer(TEXTS[3])["input_ids"]
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    for d in (one.data[0], many.data[0]):
        assert _cos(np.asarray(d.embedding), reference["vectors"][3]) >= 0.9999
    assert len(many.data) == 2


def test_dimensions_truncate_then_renormalize(client, reference: dict) -> None:
    d = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64, encoding_format="float").data[0]
    vec = np.asarray(d.embedding)
    want = reference["vectors"][0][:64]
    assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5 and _cos(vec, want) >= 0.9999


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": [[5, 30522]]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": "x", "dimensions": 385}, "dimensions"),
    ({"input": "word " * 300}, "input"),
    ({"input": "x", "model": "no-such-model"}, "model"),
])
def test_bad_input_is_a_400_in_openai_shape(embed_server: ServerProcess, body: dict, param: str) -> None:
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json=body)
    want = 404 if param == "model" else 400
    assert r.status_code == want, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == want and err["message"]


def test_over_long_input_is_truncated_when_asked(embed_server: ServerProcess) -> None:
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": "word " * 300, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256


def test_rerank_score_and_tei_shapes(embed_server: ServerProcess) -> None:
    url = embed_server.url
    docs = ["stock prices fell", "a cat is sitting on the mat", "the weather is cold"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json={"query": "a cat sits", "documents": docs, "top_n": 2}).json()
        assert [x["index"] for x in r["results"]][0] == 1 and len(r["results"]) == 2
        assert r["results"][0]["document"] == {"text": docs[1]} and r["usage"]["total_tokens"] > 0
    score = httpx.post(url + "/score", json={"text_1": "a cat sits", "text_2": docs}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2] and score["object"] == "list"
    best = max(score["data"], key=lambda d: d["score"])
    assert best["index"] == 1
    tei = httpx.post(url + "/rerank", json={"query": "a cat sits", "texts": docs, "return_text": True}).json()
    assert tei[0]["index"] == 1 and tei[0]["text"] == docs[1] and tei[0]["score"] == pytest.approx(best["score"])
    embed = httpx.post(url + "/embed", json={"inputs": ["hello", "world"]}).json()
    assert len(embed) == 2 and len(embed[0]) == 384
    bad = httpx.post(url + "/rerank", json={"query": "q", "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"


def test_metrics_count_pooling_requests_and_batches(embed_server: ServerProcess, client) -> None:
    client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    text = httpx.get(f"{embed_server.url}/metrics").text
    assert 'pagoda:pooling_requests_total{endpoint="embeddings"' in text
    assert "pagoda:pooling_batch_size_count" in text and "pagoda:pooling_queue_delay_seconds_count" in text
    models = httpx.get(f"{embed_server.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
