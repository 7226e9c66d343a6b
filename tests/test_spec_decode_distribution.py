"""Speculative sampling at temperature > 0 draws from the target's distribution: token frequencies with
speculation match those without by a chi-square test, and a wrong acceptance rule fails the same test."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import build_tiny_eagle3_head, build_tiny_model

from pagoda import LLM, SamplingParams
from pagoda.spec_decode import rejection

NUM_SAMPLES = 1000
MAX_TOKENS = 4
# Every token occurs in the prompt, so n-gram lookup proposes at every step; the penalties make p depend on
# the proposals before it.
PROMPT = list(range(16)) * 2 + [0, 1, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3,
                        max_tokens=MAX_TOKENS, min_tokens=2, ignore_eos=False)


def chi2_critical(df: int, alpha: float) -> float:
    """Upper-alpha quantile of chi-square(df), by bisection on the regularized lower incomplete gamma."""
    lo, hi = 0.0, 10.0 * df + 100.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if torch.special.gammainc(a, torch.tensor(mid / 2, dtype=torch.float64)).item() < 1 - alpha:
            lo = mid
        else:
            hi = mid
    return hi


def homogeneity_chi2(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom; cells with small counts are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for key in sorted(set(a) | set(b)):
        ca, cb = a.get(key, 0), b.get(key, 0)
        if (ca + cb) * min(na, nb) / (na + nb) < min_expected:
            pooled[0] += ca
            pooled[1] += cb
        else:
            cells.append((ca, cb))
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for ca, cb in cells:
        tot = ca + cb
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    return stat, len(cells) - 1


@pytest.fixture(scope="module")
def tiny_v16(tmp_path_factory) -> str:
    # eos_token_id 2 is in the vocabulary: min_tokens bans it for two tokens, then it may end a sample.
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_v16"), "llama", vocab_size=16))


def sample(model: str, tokenizer: str, spec: dict | None) -> tuple[list[Counter], LLM]:
    llm = LLM(model, tokenizer=tokenizer, dtype="float32", block_size=4, max_num_seqs=256,
              max_num_batched_tokens=2048, seed=1 if spec is None else 2, speculative_config=spec)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, PARAMS, use_tqdm=False)
    # Position j's marginal; positions past an EOS count as the symbol -1.
    per_pos = [Counter() for _ in range(MAX_TOKENS)]
    for o in outs:
        toks = o.outputs[0].token_ids
        for j in range(MAX_TOKENS):
            per_pos[j][toks[j] if j < len(toks) else -1] += 1
    return per_pos, llm


@pytest.fixture(scope="module")
def plain_samples(tiny_v16, default_gguf) -> list[Counter]:
    return sample(tiny_v16, default_gguf, None)[0]


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
        "adaptive": False}


def worst_position(plain: list[Counter], spec: list[Counter]) -> float:
    """Max over output positions (after the first, which comes from prefill) of chi2 / critical value."""
    ratios = []
    for j in range(1, MAX_TOKENS):
        stat, df = homogeneity_chi2(plain[j], spec[j])
        ratios.append(stat / chi2_critical(df, 0.001))
    return max(ratios)


def test_chi2_critical_matches_tables():
    assert chi2_critical(1, 0.05) == pytest.approx(3.841, abs=1e-3)
    assert chi2_critical(15, 0.001) == pytest.approx(37.697, abs=1e-3)


def test_speculative_sampling_matches_the_target_distribution(tiny_v16, default_gguf, plain_samples):
    spec_samples, llm = sample(tiny_v16, default_gguf, SPEC)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > NUM_SAMPLES  # proposals were really verified ...
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # ... some accepted, some rejected
    assert worst_position(plain_samples, spec_samples) < 1.0


def test_accepting_every_proposal_fails_the_same_test(tiny_v16, default_gguf, plain_samples, monkeypatch):
    monkeypatch.setattr(rejection, "accepts", lambda u, p_x, q_x: True)
    spec_samples, _ = sample(tiny_v16, default_gguf, SPEC)
    assert worst_position(plain_samples, spec_samples) > 1.0


def test_draft_model_sampling_matches_the_target_distribution(tiny_v16, default_gguf, plain_samples, tmp_path):
    # A different (one-layer, differently initialized) draft: q differs from p, so min(1, p/q) matters.
    draft = build_tiny_model(tmp_path / "draft", "llama", vocab_size=16, initializer_range=0.5, num_hidden_layers=1,
                             hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    cfg = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft), "adaptive": False}
    spec_samples, llm = sample(tiny_v16, default_gguf, cfg)
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert worst_position(plain_samples, spec_samples) < 1.0


def test_eagle3_sampling_matches_the_target_distribution(tiny_v16, default_gguf, plain_samples, tmp_path):
    # A draft vocabulary of every other token: q is the head's distribution placed at the target ids d2t maps
    # to, zero elsewhere; placed at the draft ids instead, the acceptance rule would be fed the wrong q.
    head = build_tiny_eagle3_head(tmp_path / "head", tiny_v16, draft_vocab_size=8)
    cfg = {"method": "eagle3", "num_speculative_tokens": 2, "model": str(head), "adaptive": False}
    spec_samples, llm = sample(tiny_v16, default_gguf, cfg)
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert worst_position(plain_samples, spec_samples) < 1.0


@pytest.mark.parametrize("wrong", [False, True], ids=["tree", "accepting-everything-fails"])
def test_eagle3_tree_sampling_matches_the_target_distribution(tiny_v16, default_gguf, plain_samples, tmp_path,
                                                              monkeypatch, wrong):
    """Draft trees at temperature > 0: each node's children (the head's top tokens) are tried as point masses in
    turn against the residual; the emitted tokens keep the target's distribution, and a wrong rule is caught."""
    head = build_tiny_eagle3_head(tmp_path / "head", tiny_v16, draft_vocab_size=8)
    cfg = {"method": "eagle3", "num_speculative_tokens": 5, "model": str(head), "adaptive": False,
           "speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (1, 0)]"}
    if wrong:
        monkeypatch.setattr(rejection, "accepts", lambda u, p_x, q_x: True)
    spec_samples, llm = sample(tiny_v16, default_gguf, cfg)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > NUM_SAMPLES
    if wrong:
        assert worst_position(plain_samples, spec_samples) > 1.0
        return
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[0] < stats.num_drafts  # the first level's children were not all accepted
    assert worst_position(plain_samples, spec_samples) < 1.0
