"""Encoder models and pooling (issue 37): tiny random encoders and cross-encoders against transformers in fp32,
the embedded all-MiniLM-L6-v2 against sentence-transformers, and the dynamic batcher against each text alone."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from pagoda.config import PoolingConfig
from pagoda.engine.pooling_batcher import PoolingBatcher
from pagoda.executor.pooling_runner import PoolingRunner
from pagoda.layers.pooler import PoolerConfig, pool
from pagoda.model.bert import load_encoder

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 6, "a",
         "Retrieval-augmented generation runs on CPUs.", "Pagoda serves embeddings beside the chat model, " * 3]


def _tiny(kind: str, tmp_path, num_labels: int | None = None):  # noqa: ANN202
    cfg_cls = {"bert": transformers.BertConfig, "xlm-roberta": transformers.XLMRobertaConfig}[kind]
    cfg = cfg_cls(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, num_labels=num_labels or 2)
    torch.manual_seed(0)
    if num_labels is None:
        model = {"bert": transformers.BertModel, "xlm-roberta": transformers.XLMRobertaModel}[kind](cfg)
    else:
        model = {"bert": transformers.BertForSequenceClassification,
                 "xlm-roberta": transformers.XLMRobertaForSequenceClassification}[kind](cfg)
    model.eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _packed(lengths: list[int], vocab: int, start: int = 3) -> tuple[list[list[int]], torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(start, vocab, (n,), generator=g).tolist() for n in lengths]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    return seqs, torch.tensor([t for s in seqs for t in s]), cu


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_tiny_cross_encoder_logits_match_transformers_fp32(kind: str, tmp_path) -> None:
    ref = _tiny(kind, tmp_path, num_labels=1)
    model = load_encoder(str(tmp_path), torch.float32)
    seqs, ids, cu = _packed([5, 17, 1, 9], ref.config.vocab_size)
    types = torch.cat([torch.tensor([0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2)) for s in seqs]) \
        if kind == "bert" else torch.zeros_like(ids)
    with torch.no_grad():
        ours = model.classify(model(ids, types, cu), cu)
        for i, s in enumerate(seqs):
            t = types[cu[i]:cu[i + 1]][None]
            want = ref(input_ids=torch.tensor([s]), token_type_ids=t).logits[0]
            assert torch.allclose(ours[i], want, atol=1e-5), (i, ours[i], want)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_tiny_encoder_hidden_states_match_transformers_fp32(kind: str, tmp_path) -> None:
    ref = _tiny(kind, tmp_path)
    model = load_encoder(str(tmp_path), torch.float32)
    seqs, ids, cu = _packed([7, 30, 2], ref.config.vocab_size)
    with torch.no_grad():
        hidden = model(ids, torch.zeros_like(ids), cu)
        for i, s in enumerate(seqs):
            want = ref(input_ids=torch.tensor([s])).last_hidden_state[0]
            assert torch.allclose(hidden[cu[i]:cu[i + 1]], want, atol=1e-5)
        means = pool(hidden, cu, "mean")
        assert torch.allclose(means[1], ref(input_ids=torch.tensor([seqs[1]])).last_hidden_state[0].mean(0),
                              atol=1e-5)


def test_pickled_weights_are_refused_with_the_file_named(tmp_path) -> None:
    _tiny("bert", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_encoder(str(tmp_path))


def test_sentence_transformers_pooling_config_is_read_as_written(tmp_path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert PoolerConfig.from_folder(str(tmp_path), "mean") == PoolerConfig("cls", True)
    (tmp_path / "modules.json").unlink()
    assert PoolerConfig.from_folder(str(tmp_path), "mean") == PoolerConfig("mean", False)


@pytest.fixture(scope="module")
def minilm() -> PoolingRunner:
    from pagoda.model.default_model import default_embedding_model_path

    try:
        path = default_embedding_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return PoolingRunner(path, torch.float32)


def test_minilm_matches_sentence_transformers_encode(minilm: PoolingRunner) -> None:
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(minilm.folder, device="cpu").encode(TEXTS, convert_to_tensor=True)
    ours = torch.stack(minilm.run([minilm.tokenize(t) for t in TEXTS]))
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.9999


def test_batcher_gives_each_text_the_vector_it_gets_alone(minilm: PoolingRunner) -> None:
    """Packed varlen batches change only the matmuls' row blocking: the same vectors up to fp32 rounding."""
    alone = [minilm.run([minilm.tokenize(t)])[0] for t in TEXTS]
    batches: list[int] = []

    class Observer:
        def on_pooling_batch(self, num_seqs: int, num_tokens: int, queue_delays: list[float]) -> None:
            batches.append(num_seqs)

    batcher = PoolingBatcher.launch(lambda: minilm, PoolingConfig(max_queue_delay_ms=200), Observer())
    try:
        futures: list = [None] * len(TEXTS)

        def send(i: int) -> None:
            futures[i] = batcher.submit([minilm.tokenize(TEXTS[i])])[0]

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(TEXTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = [f.result(timeout=60) for f in futures]
    finally:
        batcher.stop()
    assert max(batches) > 1  # they did share a forward
    for a, b in zip(alone, got):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_batcher_splits_at_the_token_budget(minilm: PoolingRunner) -> None:
    batches: list[int] = []

    class Observer:
        def on_pooling_batch(self, num_seqs: int, num_tokens: int, queue_delays: list[float]) -> None:
            batches.append(num_tokens)

    batcher = PoolingBatcher.launch(lambda: minilm, PoolingConfig(max_queue_delay_ms=50, max_num_batched_tokens=40),
                                    Observer())
    try:
        futures = batcher.submit([minilm.tokenize(t) for t in TEXTS])
        assert all(f.result(timeout=60).shape == (384,) for f in futures)
    finally:
        batcher.stop()
    longest = max(len(minilm.tokenize(t).token_ids) for t in TEXTS)
    assert len(batches) > 1 and all(n <= max(40, longest) for n in batches)


def test_over_long_input_is_refused_unless_truncation_is_asked(minilm: PoolingRunner) -> None:
    text = "word " * 400
    with pytest.raises(ValueError, match="max_model_len 256"):
        minilm.tokenize(text)
    x = minilm.tokenize(text, truncate=-1)
    assert len(x.token_ids) == 256 and x.token_ids[0] == 101 and x.token_ids[-1] == 102
    assert len(minilm.tokenize(text, truncate=10).token_ids) == 10


def test_offline_llm_embed_score_and_rerank() -> None:
    from pagoda import LLM

    try:
        llm = LLM(task="embed", dtype="float32")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    outs = llm.embed(["hello world", [101, 7592, 102]])
    assert [len(o.outputs.embedding) for o in outs] == [384, 384]
    assert len(llm.embed("hello", dimensions=64)[0].outputs.embedding) == 64
    scores = [o.outputs.score for o in llm.score("a cat sits", ["a cat is sitting", "stock prices fell"])]
    assert scores[0] > scores[1]
    ranked = llm.rerank("a cat sits", ["stock prices fell", "a cat is sitting"], top_n=1)
    assert ranked == [{"index": 1, "relevance_score": pytest.approx(scores[0]), "document": "a cat is sitting"}]


def test_batcher_launch_builds_the_runner_on_its_own_thread() -> None:
    """PoolingBatcher.launch: the runner is built on the batcher's thread (so the model's OpenMP regions all open
    there), which then runs its batches; a failed build is raised to the caller."""
    from types import SimpleNamespace

    built_on: list[threading.Thread] = []

    def build() -> SimpleNamespace:
        built_on.append(threading.current_thread())
        return SimpleNamespace(run=lambda items: [torch.tensor([float(len(i.token_ids))]) for i in items])

    batcher = PoolingBatcher.launch(build, PoolingConfig(max_queue_delay_ms=1))
    assert built_on[0].name == "pagoda-pooling" and built_on[0] is not threading.main_thread()
    (future,) = batcher.submit([SimpleNamespace(token_ids=[1, 2, 3])])
    assert future.result(10).item() == 3.0
    batcher.stop()
    assert not built_on[0].is_alive()

    def broken() -> SimpleNamespace:
        raise ValueError("not a pooling model")

    with pytest.raises(ValueError, match="not a pooling model"):
        PoolingBatcher.launch(broken, PoolingConfig())
