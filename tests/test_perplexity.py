"""`pagoda eval perplexity`: sliding windows scored through the engine equal HF transformers' numbers."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from pagoda.bench.datasets import CORPUS_PATH
from pagoda.eval.perplexity import perplexity, sliding_windows

GPL3 = str(CORPUS_PATH)


def test_windows_score_every_token_but_the_first_exactly_once():
    for n, length, stride in ((1000, 128, 64), (130, 128, 64), (1000, 100, 99), (57, 512, 256), (2, 2, 1)):
        scored = []
        for w in sliding_windows(n, length, stride):
            assert w.end - w.begin <= length and 0 < w.num_scored < w.end - w.begin + 1
            scored += range(w.end - w.num_scored, w.end)
        assert sorted(scored) == list(range(1, n)), (n, length, stride)
    # stride == max_length: disjoint windows, each window's first token has no context (as in HF's guide)
    assert [w.num_scored for w in sliding_windows(300, 100, 100)] == [99, 99, 99]


def _hf_perplexity(model_dir: str, ids: list[int], max_length: int, stride: int) -> float:
    """The HF perplexity guide's loop (labels -100 outside the newly scored tail), summed exactly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for w in sliding_windows(len(ids), max_length, stride):
        x = torch.tensor([ids[w.begin:w.end]])
        with torch.no_grad():
            logp = model(x).logits[0, :-1].log_softmax(-1)
        tok_lp = logp.gather(1, x[0, 1:].unsqueeze(1)).squeeze(1)
        nll -= tok_lp[-w.num_scored:].double().sum().item()
        count += w.num_scored
    return math.exp(nll / count)


def test_perplexity_matches_hf_on_a_tiny_model(tiny_llama_byte_tokenizer):
    from pagoda import LLM

    llm = LLM(str(tiny_llama_byte_tokenizer), dtype="float32", kv_cache_memory="64MiB")
    with open(GPL3, encoding="utf-8") as f:
        ids = llm.get_tokenizer().encode(f.read(), add_special_tokens=False)[:700]
    assert len(ids) == 700
    res = perplexity(llm, ids, max_length=128, stride=64)
    assert res.num_scored == 699 and res.num_windows == len(sliding_windows(700, 128, 64))
    ref = _hf_perplexity(str(tiny_llama_byte_tokenizer), ids, 128, 64)
    assert res.perplexity == pytest.approx(ref, rel=1e-3)
    assert res.tokens_per_s > 0


def test_default_model_gives_a_finite_perplexity_on_gpl3(smollm_llm):
    assert os.path.getsize(GPL3) > 30000  # Debian base-files' GNU GPL v3
    with open(GPL3, encoding="utf-8") as f:
        ids = smollm_llm.get_tokenizer().encode(f.read(), add_special_tokens=False)
    assert len(ids) > 7000
    res = perplexity(smollm_llm, ids[:384], max_length=256, stride=128)
    # A 135M instruct model on legal English: well below uniform over its 49152 tokens.
    assert math.isfinite(res.perplexity) and 2 < res.perplexity < 100, res


@pytest.mark.slow  # the whole text through the CLI: minutes on 2 cores
def test_cli_perplexity_json_on_full_gpl3(capsys):
    from pagoda.entrypoints.cli import main

    assert main(["eval", "perplexity", "--text", GPL3, "--dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert math.isfinite(out["perplexity"]) and 2 < out["perplexity"] < 100
    assert out["num_scored"] > 7000 and out["tokens_per_s"] > 0
