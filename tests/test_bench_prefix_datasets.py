"""Prefix-sharing benchmark workloads and their theoretical best hit rate."""
from __future__ import annotations

from pagoda.bench.datasets import BenchRequest, max_prefix_hit_rate, multi_turn_requests, shared_prefix_requests


class WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(w) % 5000 for w in text.split()]


def test_max_prefix_hit_rate_counts_full_shared_blocks_only():
    a = BenchRequest(list(range(10)), 4)
    b = BenchRequest(list(range(8)) + [99, 98], 4)  # shares 8 tokens = 2 blocks of 4
    c = BenchRequest(list(range(8)), 4)             # a full hit still computes its last token: 1 block
    assert max_prefix_hit_rate([a], 4) == 0
    assert max_prefix_hit_rate([a, b], 4) == 8 / 20
    assert max_prefix_hit_rate([a, b, c], 4) == (8 + 4) / 28


def test_shared_prefix_workload_shape_and_hit_rate():
    reqs = shared_prefix_requests(WordTokenizer(), num_prompts=40, num_prefixes=4, prefix_len=64, question_len=8,
                                  output_len_range=(4, 8), seed=3)
    assert len(reqs) == 40 and all(len(r.prompt_token_ids) == 72 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:64]) for r in reqs}) == 4
    assert reqs == shared_prefix_requests(WordTokenizer(), 40, 4, 64, 8, (4, 8), seed=3)
    # 4 cold prefixes, 36 warm ones hitting all 64 prefix tokens
    assert max_prefix_hit_rate(reqs, 16) == 36 * 64 / (40 * 72)


def test_multi_turn_replay_grows_each_conversation():
    reqs = multi_turn_requests(WordTokenizer(), num_conversations=2, num_turns=3, system_len=10, user_len=5,
                               assistant_len=7)
    assert len(reqs) == 6
    first, later = reqs[0].prompt_token_ids, reqs[2].prompt_token_ids  # conversation 0, turns 1 and 2
    assert later[:len(first)] == first and len(later) == len(first) + 7 + 5
    assert max_prefix_hit_rate(reqs, 4) > 0.4
