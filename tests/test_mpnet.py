"""MPNet encoders (issue 37): a tiny random MPNet against transformers in fp32 (hidden states and a cross-encoder's
logits, with sequences long enough to reach the log-spaced and the last relative-position buckets), and a
sentence-transformers folder around it against SentenceTransformer.encode."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagoda.executor.pooling_runner import PoolingRunner
from pagoda.model.bert import load_encoder, relative_position_bucket

transformers = pytest.importorskip("transformers")

# Distances past 8 fall in log-spaced buckets, and past 128 in the last one.
LENGTHS = [7, 140, 1, 80]
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 9, "a",
         "Retrieval-augmented generation runs on CPUs.", "Pagoda serves embeddings beside the chat model, " * 18]


def _save_tokenizer(folder: Path) -> int:
    """A word-level tokenizer.json over TEXTS' words with MPNet's special tokens (<s> 0, <pad> 1, </s> 2) and
    template, and a tokenizer_config.json that lets transformers load it; returns the vocabulary's size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    split = pre_tokenizers.Whitespace()
    words = sorted({w for t in TEXTS for w, _ in split.pre_tokenize_str(t.lower())})
    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = split
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 512}))
    return len(vocab)


def _tiny_mpnet(folder: Path, vocab_size: int, num_labels: int | None = None):  # noqa: ANN202
    cfg = transformers.MPNetConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=258,
                                   relative_attention_num_buckets=32, num_labels=num_labels or 2)
    torch.manual_seed(0)
    model = transformers.MPNetModel(cfg) if num_labels is None else transformers.MPNetForSequenceClassification(cfg)
    with torch.no_grad():  # at its init scale (0.02) the bias barely moves a score; make each bucket count
        encoder = model.encoder if num_labels is None else model.mpnet.encoder
        encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory) -> tuple[Path, transformers.MPNetModel]:
    folder = tmp_path_factory.mktemp("mpnet")
    return folder, _tiny_mpnet(folder, _save_tokenizer(folder))


def _packed(lengths: list[int], vocab: int) -> tuple[list[list[int]], torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]  # no <pad>: HF would skip it
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    return seqs, torch.tensor([t for s in seqs for t in s]), cu


def test_relative_position_buckets_match_transformers() -> None:
    relative = torch.arange(-300, 301)[None, :]
    want = transformers.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket(relative)
    assert torch.equal(relative_position_bucket(relative), want)


def test_tiny_mpnet_hidden_states_match_transformers_fp32(mpnet) -> None:
    folder, ref = mpnet
    model = load_encoder(str(folder), torch.float32)
    seqs, ids, cu = _packed(LENGTHS, ref.config.vocab_size)
    with torch.no_grad():
        hidden = model(ids, torch.zeros_like(ids), cu)
        for i, s in enumerate(seqs):
            want = ref(input_ids=torch.tensor([s])).last_hidden_state[0]
            assert torch.allclose(hidden[cu[i]:cu[i + 1]], want, atol=1e-5), i


def test_tiny_mpnet_cross_encoder_logits_match_transformers_fp32(tmp_path) -> None:
    ref = _tiny_mpnet(tmp_path, 120, num_labels=1)
    model = load_encoder(str(tmp_path), torch.float32)
    seqs, ids, cu = _packed([5, 140, 1, 9], 120)
    with torch.no_grad():
        ours = model.classify(model(ids, torch.zeros_like(ids), cu), cu)
        for i, s in enumerate(seqs):
            want = ref(input_ids=torch.tensor([s])).logits[0]
            assert torch.allclose(ours[i], want, atol=1e-5), (i, ours[i], want)


def test_sentence_transformers_mpnet_folder_matches_encode(mpnet, tmp_path) -> None:
    """Mean pooling and Normalize as all-mpnet-base-v2's folder has them; its config names MPNetForMaskedLM,
    as mpnet-base's does, over the encoder's weights."""
    st = pytest.importorskip("sentence_transformers")
    folder, _ = mpnet
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MPNetForMaskedLM"]}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                    "pooling_mode_mean_tokens": True}))
    (tmp_path / "2_Normalize").mkdir()
    ref = st.SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    runner = PoolingRunner(str(tmp_path), torch.float32)
    assert (runner.pooler.mode, runner.pooler.normalize, runner.max_model_len) == ("mean", True, 256)
    inputs = [runner.tokenize(t) for t in TEXTS]
    assert max(len(x.token_ids) for x in inputs) > 140
    ours = torch.stack(runner.run(inputs))
    assert torch.nn.functional.cosine_similarity(ours, ref).min() >= 0.9999
    # Mean pooling averages much of a tiny model's attention away: the vectors must also agree to fp32 rounding.
    assert torch.allclose(ours, ref, atol=1e-5)
