"""Speculative decoding: greedy outputs identical to plain decoding for every method (mixed batch,
preemption, prefix caching, n > 1, penalties, stops, logprobs), config validation, and n-gram proposals."""
from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import build_tiny_eagle3_head, build_tiny_model

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.spec_decode.ngram import NgramProposer, ngram_propose

# Token ids < 32: a 32-token vocabulary makes greedy output of a random tiny model fall into loops (as real
# models do when they copy from their input), so n-gram proposals get accepted.
# The fifth shares 20 tokens with the fourth and is the longest: it starts (shortest remaining first) once
# the fourth's blocks are cached.
PROMPTS = [[5, 6, 7, 8] * 4, list(range(3, 30)), [7], list(range(20, 30)) * 2 + [1, 2],
           list(range(20, 30)) * 2 + [3] + [4] * 12, [9, 10, 11, 12] * 3 + [13]]
BLOCK = 4
TINY_BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_v32"), "llama", vocab_size=32))


@pytest.fixture(scope="module")
def tiny_draft_1layer(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_draft"), "llama", vocab_size=32, num_hidden_layers=1))


@pytest.fixture(scope="module")
def tiny_eagle3(tmp_path_factory, tiny_v32) -> str:
    return str(build_tiny_eagle3_head(tmp_path_factory.mktemp("tiny_eagle3"), tiny_v32, draft_vocab_size=16))


def _params() -> list[SamplingParams]:
    base = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    ps = [SamplingParams(**base) for _ in PROMPTS]
    ps[1] = SamplingParams(**base, n=2)
    ps[2] = SamplingParams(**base, repetition_penalty=1.3, presence_penalty=0.2)
    ps[5] = SamplingParams(**base, logprobs=2)
    return ps


@pytest.fixture(scope="module")
def reference(tiny_v32, default_gguf):
    llm = LLM(tiny_v32, tokenizer=default_gguf, dtype="float32", block_size=BLOCK)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], outs[5].outputs[0].logprobs


def _spec_llm(tiny_llama: str, default_gguf: str, cfg: dict) -> LLM:
    # 32 blocks of 4 tokens cannot hold all seven sequences: preemption must occur.
    return LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", block_size=BLOCK,
               kv_cache_memory=32 * TINY_BLOCK_BYTES, max_num_batched_tokens=64, speculative_config=cfg)


@pytest.mark.parametrize("cfg", [
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
    {"method": "self", "num_speculative_tokens": 3, "num_draft_layers": 1, "adaptive": False},
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "TARGET", "adaptive": False},
    {"method": "draft_model", "num_speculative_tokens": 2, "model": "TINY1", "adaptive": False},
    {"method": "eagle3", "num_speculative_tokens": 3, "model": "EAGLE3", "adaptive": False},
    {"method": "eagle3", "num_speculative_tokens": 4, "model": "EAGLE3"},
    {"method": "eagle3", "num_speculative_tokens": 8, "model": "EAGLE3", "adaptive": False,
     "speculative_token_tree": "[(0,), (1,), (2,), (3,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]"},
    {"method": "eagle3", "num_speculative_tokens": 6, "model": "EAGLE3",
     "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 0, 0], [0, 0, 0, 0]]},
], ids=["ngram", "ngram-adaptive", "self", "draft-is-target", "draft-1-layer", "eagle3", "eagle3-adaptive",
        "eagle3-tree", "eagle3-tree-adaptive"])
def test_greedy_speculation_matches_plain_decoding_token_for_token(cfg, tiny_v32, default_gguf, reference,
                                                                   tiny_draft_1layer, tiny_eagle3):
    tiny_llama = tiny_v32
    ref_tokens, ref_logprobs = reference
    cfg = dict(cfg)
    if cfg.get("model") == "TARGET":
        cfg["model"] = tiny_llama
    elif cfg.get("model") == "TINY1":
        cfg["model"] = tiny_draft_1layer
    elif cfg.get("model") == "EAGLE3":
        cfg["model"] = tiny_eagle3
    llm = _spec_llm(tiny_llama, default_gguf, cfg)
    engine = llm.engine
    assert engine.kv.pool.num_blocks == 32
    moved: list[tuple[int, int]] = []  # a draft tree's accepted nodes' KV moves (engine._settle_trees)
    move_slots = engine.runner.move_slots
    engine.runner.move_slots = lambda moves: (moved.extend(moves), move_slots(moves))
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == ref_tokens
    assert engine.kv.stats.hits > 0  # the two prompts with a shared 20-token prefix
    assert engine.scheduler.num_preemptions > 0
    stats = engine.speculator.stats
    if cfg.get("adaptive") is False and cfg["method"] not in ("draft_model", "eagle3") \
            or cfg.get("model") == tiny_llama:
        assert stats.num_accepted_tokens > 0, "speculation never happened"
    if cfg.get("model") == tiny_llama:  # the target as its own draft: (nearly) everything is accepted
        assert stats.acceptance_rate > 0.9
    per_pos = stats.accepted_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    if cfg.get("adaptive") is False:
        assert stats.num_draft_tokens > 0, "nothing was drafted"
    if "speculative_token_tree" in cfg and cfg.get("adaptive") is False:
        assert moved, "no branch but the first was ever accepted: the trees' KV moves went untested"
    # Logprobs of emitted tokens are the target's, as without speculation (up to batch-shape rounding).
    for got, want in zip(outs[5].outputs[0].logprobs, ref_logprobs):
        assert got.keys() == want.keys()
        for t in got:
            assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks, "blocks leaked"
    assert not engine.kv.block_tables


def test_stop_token_inside_accepted_run_truncates_like_plain_decoding(tiny_v32, default_gguf, reference):
    ref_tokens, _ = reference
    loop = ref_tokens[5][0]  # 12 12 12 ... then something else: stop on that
    stop = next(t for t in loop if t != loop[0])
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
    plain = LLM(tiny_v32, tokenizer=default_gguf, dtype="float32", block_size=BLOCK)
    want = plain.generate([PROMPTS[5]], params, use_tqdm=False)[0].outputs[0]
    spec = _spec_llm(tiny_v32, default_gguf, {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False})
    got = spec.generate([PROMPTS[5]], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and want.token_ids[-1] == stop
    assert got.finish_reason == want.finish_reason == "stop"
    assert spec.engine.speculator.stats.num_accepted_tokens > 0


def test_speculation_counts_in_the_token_budget(tiny_v32, default_gguf, monkeypatch):
    llm = _spec_llm(tiny_v32, default_gguf, {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    sched = llm.engine.scheduler
    seen: list[tuple[int, int]] = []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        for seq, n in zip(out.seqs, out.num_scheduled):
            if seq.spec_token_ids:  # a verification: the last token plus every proposal left after the budget
                assert seq.num_computed_tokens == seq.num_tokens - 1
                assert n == 1 + len(seq.spec_token_ids)
                seen.append(n)
        assert out.total_tokens <= sched.config.max_num_batched_tokens
        return out

    monkeypatch.setattr(sched, "schedule", recording_schedule)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert seen and max(seen) == 5


# ---- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, key", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "self", "num_speculative_tokens": 2}, "num_draft_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_draft_layers": 1}, "num_draft_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1,)]"},
     "speculative_token_tree"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "speculative_token_tree": "[(0,), (1,)]"},
     "num_speculative_tokens"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (0, 1)]"},
     "speculative_token_tree"),  # (0, 1) without its sibling (0, 0)
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1, 0)]"},
     "speculative_token_tree"),  # (1, 0) without its parent
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 1, "speculative_token_tree": "__import__('os')"},
     "speculative_token_tree"),  # read as a literal, never evaluated
])
def test_bad_speculative_config_names_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_dict(cfg)


def test_config_defaults_use_vllm_names():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.adaptive) == (1, 4, True)


def test_a_tree_rank_past_the_draft_vocabulary_is_refused(tiny_v32, default_gguf, tiny_eagle3):
    with pytest.raises(ValueError, match="speculative_token_tree: a rank past the head's draft vocabulary of 16"):
        LLM(tiny_v32, tokenizer=default_gguf, dtype="float32",
            speculative_config={"method": "eagle3", "model": tiny_eagle3, "num_speculative_tokens": 17,
                                "speculative_token_tree": [[r] for r in range(17)]})


def test_self_draft_must_be_shallower_than_the_model(tiny_v32, default_gguf):
    with pytest.raises(ValueError, match="num_draft_layers"):
        LLM(tiny_v32, tokenizer=default_gguf, dtype="float32",
            speculative_config={"method": "self", "num_speculative_tokens": 2, "num_draft_layers": 2})


def test_draft_model_with_another_vocabulary_is_rejected(tiny_v32, default_gguf, tmp_path: Path):
    other = build_tiny_model(tmp_path / "v64", "llama", vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_v32, tokenizer=default_gguf, dtype="float32",
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(other)})


# ---- n-gram proposer -----------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_match():
    assert ngram_propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 2, 1, 3) == [5, 7]


def test_ngram_prefers_the_longest_suffix():
    # "3" alone last occurred before 8; the 2-gram "2 3" only before 4.
    assert ngram_propose([2, 3, 4, 0, 3, 8, 2, 3], 1, 1, 2) == [4]
    assert ngram_propose([2, 3, 4, 0, 3, 8, 2, 3], 1, 1, 1) == [8]


def test_ngram_respects_min_and_returns_nothing_without_a_match():
    assert ngram_propose([1, 2, 3, 4, 5], 3, 1, 3) == []
    assert ngram_propose([1, 2, 9, 2], 2, 2, 3) == []  # only a 1-gram recurs
    assert ngram_propose([1, 2, 9, 2], 2, 1, 3) == [9, 2]
    assert ngram_propose([1, 2], 0, 1, 3) == []


def test_ngram_extends_a_loop_with_its_period():
    assert ngram_propose([1, 1, 1, 1], 3, 1, 2) == [1, 1, 1]
    assert ngram_propose([4, 5, 6, 4, 5, 6, 4], 5, 1, 3) == [5, 6, 4, 5, 6]


def test_ngram_proposer_batches_per_request_k():
    prop = NgramProposer(1, 2)
    assert prop.propose([[1, 2, 1], [3, 4, 5], [7, 8, 7, 8]], [2, 2, 1]) == [[2, 1], [], [7]]


def test_spec_counters_reach_the_metrics_endpoint():
    from pagoda.engine.stats import EngineStats
    from pagoda.entrypoints.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.on_step(EngineStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12,
                          spec_decode_num_accepted_tokens=7, spec_decode_num_emitted_tokens=10,
                          spec_decode_num_accepted_tokens_per_pos=(3, 3, 1)))
    m.on_step(EngineStats(spec_decode_num_accepted_tokens_per_pos=(3, 4, 1)))
    text = m.render().decode()
    assert 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    assert 'pagoda:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'pagoda:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text


def test_adaptive_policy_speculates_alone_but_not_in_a_compute_bound_batch():
    from pagoda.spec_decode.adaptive import AdaptivePolicy, StepCostModel

    # A forward costs 20 ms + 5 ms per token (a 2-core CPU on a 135M model, roughly).
    policy = AdaptivePolicy(StepCostModel(c0=0.020, c1=0.005))
    policy.alpha[0] = 0.8
    assert policy.choose([0], [8], other_tokens=0)[0] >= 2
    ids = list(range(16))
    for s in ids:
        policy.alpha[s] = 0.6
    assert sum(policy.choose(ids, [8] * 16, other_tokens=0)) == 0
    policy.alpha[0] = 0.05  # a request whose proposals keep failing stops speculating even alone
    assert policy.choose([0], [8], other_tokens=0) == [0]
    policy.update(0, 4, 4)
    assert policy.alpha[0] > 0.05
