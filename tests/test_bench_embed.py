"""`pagoda bench embed`: its sentences fit the asked token range, and a tiny run prints both sides and the
ratios (the real benchmark's figures live in docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import json

import pytest

from pagoda.bench import embed


@pytest.fixture(scope="module")
def minilm_folder() -> str:
    from pagoda.model.default_model import default_embedding_model_path

    try:
        return default_embedding_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_sentences_are_corpus_windows_within_the_token_range(minilm_folder: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{minilm_folder}/tokenizer.json")
    tok.no_truncation()
    tok.no_padding()
    texts = embed.sentences(tok, 50, 8, 64, seed=0, corpus_path=str(embed.CORPUS_PATH))
    lengths = [len(tok.encode(t).ids) for t in texts]
    # Decoding and encoding again may merge or split a word piece at the window's edges.
    assert min(lengths) >= 7 and max(lengths) <= 66 and len(set(lengths)) > 10


@pytest.mark.slow
def test_a_tiny_run_reports_both_sides_and_the_ratios(minilm_folder: str, tmp_path, capsys) -> None:
    pytest.importorskip("sentence_transformers")
    p = argparse.ArgumentParser()
    embed.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--num-sentences", "8", "--max-tokens", "48", "--batch-size", "4", "--rounds", "1",
                         "--latency-samples", "2", "--threads", "1", "--output-json", str(out)])
    assert embed.main(args) == 0
    printed = capsys.readouterr().out
    assert "throughput at batch 4: Pagoda" in printed and "sentence-transformers" in printed
    report = json.loads(out.read_text())
    assert report["min_cosine"] > 0.9999 and report["throughput_ratio"] > 0 and report["latency_ratio"] > 0
    assert [len(s["latency_ms"]) for s in report["sides"]] == [2, 2]
