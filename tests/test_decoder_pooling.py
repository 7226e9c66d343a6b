"""Causal LMs as pooling models (issue 37): a tiny random Qwen3 as an embedder (last-token and mean pooling)
and as a Qwen3-Reranker-style scorer (the logits of "no"/"yes"), against transformers in fp32; a mixed batch
against each text alone; LLM(task="embed"|"score") over a causal LM folder."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import build_tiny_model

from pagoda.executor.pooling_runner import PoolingRunner

transformers = pytest.importorskip("transformers")

LENGTHS = [5, 23, 1, 12]


def _with_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer.json that appends <|endoftext|> as Qwen3-Embedding's does, with "no" and "yes"
    as single tokens (ids 256.. fit the tiny vocab of 512)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.add_tokens(["no", "yes"])
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A $B:1 <|endoftext|>:1",
                                                       special_tokens=[("<|endoftext|>", eot)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    """A tiny Qwen3 with its own lm_head (untied), as a reranker's is, and a tokenizer."""
    return str(_with_tokenizer(build_tiny_model(tmp_path_factory.mktemp("qwen3_embed"), "qwen3")))


def _seqs(lengths: list[int], vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_hidden(folder: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    ref = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [ref(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs]


def test_tiny_qwen3_last_token_embeddings_match_transformers_fp32(qwen3: str) -> None:
    runner = PoolingRunner(qwen3, torch.float32)
    assert (runner.pooler.mode, runner.pooler.normalize) == ("lasttoken", True)  # no 1_Pooling: Qwen3-Embedding's
    seqs = _seqs(LENGTHS)
    ours = runner.run([runner.from_token_ids(s) for s in seqs])
    for got, want in zip(ours, _hf_hidden(qwen3, seqs)):
        assert torch.allclose(got, F.normalize(want[-1], dim=-1), atol=1e-5)


def test_sentence_transformers_mean_pooling_of_a_decoder_matches_transformers(qwen3: str, tmp_path) -> None:
    folder = tmp_path / "mean"
    shutil.copytree(qwen3, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    runner = PoolingRunner(str(folder), torch.float32)
    assert (runner.pooler.mode, runner.pooler.normalize) == ("mean", False)
    seqs = _seqs(LENGTHS)
    for got, want in zip(runner.run([runner.from_token_ids(s) for s in seqs]), _hf_hidden(qwen3, seqs)):
        assert torch.allclose(got, want.mean(0), atol=1e-5)


def test_a_mixed_batch_gives_each_sequence_its_vector_alone(qwen3: str) -> None:
    runner = PoolingRunner(qwen3, torch.float32)
    inputs = [runner.from_token_ids(s) for s in _seqs([40, 3, 17, 1, 29])]
    together = runner.run(inputs)
    for x, got in zip(inputs, together):
        assert torch.allclose(runner.run([x])[0], got, atol=1e-6, rtol=0)


def test_a_base_model_checkpoint_without_lm_head_embeds(tmp_path) -> None:
    """Qwen3-Embedding's layout: saved from Qwen3Model (no "model." prefix, no lm_head, untied config)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    transformers.Qwen3Model(cfg).eval().save_pretrained(tmp_path, safe_serialization=True)
    _with_tokenizer(tmp_path)
    runner = PoolingRunner(str(tmp_path), torch.float32)
    seqs = _seqs([7, 2])
    for got, want in zip(runner.run([runner.from_token_ids(s) for s in seqs]), _hf_hidden(str(tmp_path), seqs)):
        assert torch.allclose(got, F.normalize(want[-1], dim=-1), atol=1e-5)


def test_decoder_reranker_scores_are_p_yes_from_transformers_logits(qwen3: str) -> None:
    runner = PoolingRunner(qwen3, torch.float32, classifier_from_token=["no", "yes"])
    assert runner.is_cross_encoder
    no, yes = runner.tokenizer.token_to_id("no"), runner.tokenizer.token_to_id("yes")
    pairs = [("what is a cat", "a cat is a small animal"), ("q", "an unrelated document, longer than the query")]
    inputs = [runner.tokenize(a, b) for a, b in pairs]
    ours = runner.run(inputs)
    ref = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    for x, got in zip(inputs, ours):
        with torch.no_grad():
            last = ref(input_ids=torch.tensor([x.token_ids])).logits[0, -1]
        want = torch.softmax(last[[no, yes]], dim=-1)[1]
        assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_llm_embeds_and_scores_with_a_causal_lm_folder(qwen3: str) -> None:
    from pagoda import LLM

    emb = LLM(qwen3, task="embed", dtype="float32")
    outs = emb.embed(["hello world", "a"])
    assert [len(o.outputs.embedding) for o in outs] == [64, 64]
    assert outs[0].prompt_token_ids[-1] == emb.pooling.runner.tokenizer.token_to_id("<|endoftext|>")
    assert abs(torch.tensor(outs[0].outputs.embedding).norm().item() - 1) < 1e-5
    rr = LLM(qwen3, task="score", dtype="float32", classifier_from_token=["no", "yes"])
    scores = [o.outputs.score for o in rr.score("query", ["doc one", "doc two"])]
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)
    with pytest.raises(ValueError, match="not one token"):
        LLM(qwen3, task="score", dtype="float32", classifier_from_token=["no", "certainly"])
