"""Sampler: distributions, seeds, truncation, penalties, and parameter validation."""
from __future__ import annotations

import math

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.layers.sampler import Sampler, SamplingBatch


def batch_of(params: list[SamplingParams], gens=None, outputs=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=params, generators=gens or [None] * n, output_token_ids=outputs or [[]] * n,
                         prompt_token_ids=[[]] * n, banned_token_ids=[[]] * n)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; returns the upper-tail p-value (Wilson-Hilferty approx)."""
    keep = probs > 0
    n = counts.sum().item()
    expected = probs[keep] * n
    stat = (((counts[keep] - expected) ** 2) / expected).sum().item()
    k = int(keep.sum().item()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_counts(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    torch.manual_seed(1234)
    sampler = Sampler()
    rows = logits.repeat(draws, 1)
    toks = sampler(rows, batch_of([params] * draws)).token_ids
    return torch.bincount(torch.tensor(toks), minlength=logits.shape[1]).float()


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


def test_sampled_frequencies_match_softmax_with_temperature():
    params = SamplingParams(temperature=0.7)
    probs = (LOGITS[0] / 0.7).softmax(-1)
    assert chi_square_p_value(sample_counts(LOGITS, params, 20000), probs) > 1e-3


def test_top_k_top_p_min_p_truncate_then_renormalize():
    probs = LOGITS[0].softmax(-1)
    counts = sample_counts(LOGITS, SamplingParams(top_k=3), 20000)
    assert counts[3:].sum() == 0
    ref = torch.zeros_like(probs)
    ref[:3] = probs[:3] / probs[:3].sum()
    assert chi_square_p_value(counts, ref) > 1e-3
    # top_p: keep the smallest prefix whose mass reaches 0.6
    counts = sample_counts(LOGITS, SamplingParams(top_p=0.6), 20000)
    keep = int(((probs.cumsum(0) - probs) < 0.6).sum())
    assert counts[keep:].sum() == 0 and counts[:keep].min() > 0
    counts = sample_counts(LOGITS, SamplingParams(min_p=0.3), 5000)
    assert counts[probs < 0.3 * probs.max()].sum() == 0


def test_wrong_distribution_fails_the_chi_square_check():
    # Guard on the test itself: a sampler drawing from the untempered softmax must be rejected.
    counts = sample_counts(LOGITS, SamplingParams(temperature=1.0), 20000)
    assert chi_square_p_value(counts, (LOGITS[0] / 0.7).softmax(-1)) < 1e-6


def test_seeded_rows_reproduce_whatever_else_is_in_the_batch():
    sampler = Sampler()
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sampler(logits, batch_of([p], [torch.Generator().manual_seed(7)])).token_ids
    mixed_logits = torch.cat([torch.randn(3, 50), logits])
    params = [SamplingParams(temperature=1.0)] * 3 + [p]
    mixed = sampler(mixed_logits, batch_of(params, [None, None, None, torch.Generator().manual_seed(7)])).token_ids
    assert mixed[3] == alone[0]


def test_penalties_push_down_seen_tokens():
    sampler = Sampler()
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    assert sampler(logits, batch_of([SamplingParams(temperature=0)])).token_ids == [0]
    for p in (SamplingParams(temperature=0, presence_penalty=0.5),
              SamplingParams(temperature=0, frequency_penalty=0.5),
              SamplingParams(temperature=0, repetition_penalty=1.5)):
        assert sampler(logits, batch_of([p], outputs=[[0]])).token_ids == [1], p


@pytest.mark.parametrize("kw,name", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                     ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                     ({"n": 0}, "n"), ({"top_k": -5}, "top_k"), ({"min_p": 2.0}, "min_p"),
                                     ({"logprobs": -1}, "logprobs"), ({"presence_penalty": 3.0}, "presence_penalty")])
def test_bad_parameters_raise_value_error_naming_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_engine_seeded_sampling_is_reproducible_in_any_batch(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32")
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [others, p, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = llm.generate([[5, 6, 7]] * 4, others, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_logprobs_shape_and_finish_reasons(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 2 <= len(entry) <= 3
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) < 1e-5
    # stop_token_ids end the sequence with finish_reason "stop"
    first = out.token_ids[2]
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == first and stopped.stop_reason == first
    # min_tokens suppresses the stop token until reached
    later = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=6,
                                                     stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) >= 6


def test_logit_bias_steers_greedy_and_sampled_tokens(smollm_llm) -> None:
    from pagoda import SamplingParams

    prompt = "The capital of France is"
    (base,) = smollm_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    first = base.outputs[0].token_ids[0]
    forced = 1234
    for temperature in (0.0, 0.9):
        (out,) = smollm_llm.generate([prompt], SamplingParams(temperature=temperature, seed=1, max_tokens=4,
                                                              ignore_eos=True, logit_bias={forced: 100}),
                                     use_tqdm=False)
        assert out.outputs[0].token_ids == [forced] * 4
    (out,) = smollm_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}),
                                 use_tqdm=False)
    assert out.outputs[0].token_ids[0] != first


@pytest.mark.parametrize("bias", [{1: 101}, {1: float("nan")}, {-1: 1.0}, {"1": 1.0}, {1: True}])
def test_logit_bias_out_of_range_is_refused(bias) -> None:
    from pagoda import SamplingParams

    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
