"""The benchmark pieces: workload, roofline arithmetic, HF peer counting, and `pagoda bench throughput`."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from pagoda.bench.datasets import CORPUS_PATH, BenchRequest, synthetic_chat_requests
from pagoda.bench.roofline import (
    decode_weight_bytes,
    flops_per_token,
    lm_head_params,
    measure_matmul_flops,
    measure_read_bandwidth,
    non_embedding_params,
    request_flops,
    workload_flops,
)
from pagoda.model.args import ModelArgs


class WordTokenizer:
    """A stand-in tokenizer: one id per distinct word, so dataset tests need no model."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r"\S+", text)]


def smollm2_135m() -> ModelArgs:
    return ModelArgs(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


# ---- dataset -------------------------------------------------------------------------------------
def test_dataset_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    a = synthetic_chat_requests(WordTokenizer(), 32, (16, 512), (16, 256), seed=7)
    b = synthetic_chat_requests(WordTokenizer(), 32, (16, 512), (16, 256), seed=7)
    c = synthetic_chat_requests(WordTokenizer(), 32, (16, 512), (16, 256), seed=8)
    assert a == b
    assert a != c


def test_dataset_lengths_stay_in_range_and_prompts_start_at_different_offsets() -> None:
    reqs = synthetic_chat_requests(WordTokenizer(), 200, (16, 512), (16, 256), seed=0)
    assert len(reqs) == 200 and all(isinstance(r, BenchRequest) for r in reqs)
    assert all(16 <= len(r.prompt_token_ids) <= 512 for r in reqs)
    assert all(16 <= r.output_len <= 256 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:8]) for r in reqs}) > 150
    # Log-uniform: the median sits near the geometric mean of the range, well below the midpoint.
    median = sorted(len(r.prompt_token_ids) for r in reqs)[100]
    assert 40 < median < 200, median


def test_dataset_serves_prompts_longer_than_the_corpus() -> None:
    words = len(WordTokenizer().encode(CORPUS_PATH.read_text()))
    reqs = synthetic_chat_requests(WordTokenizer(), 3, (words + 10, words + 10), (1, 1), seed=0)
    assert all(len(r.prompt_token_ids) == words + 10 for r in reqs)


def test_dataset_rejects_bad_ranges_and_missing_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        synthetic_chat_requests(WordTokenizer(), 4, (20, 10), (1, 2))
    with pytest.raises(FileNotFoundError):
        synthetic_chat_requests(WordTokenizer(), 4, (1, 2), (1, 2), corpus_path=tmp_path / "none")


# ---- roofline arithmetic -------------------------------------------------------------------------
def test_model_cost_by_hand_for_a_toy_config() -> None:
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=8,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2)
    # q 4x4 + k,v 4x2 each + o 4x4 = 48; gate/up/down 3*4*8 = 96; two layer norms 8; final norm 4.
    assert non_embedding_params(args) == 156
    assert flops_per_token(args, sampled=False) == 312
    assert flops_per_token(args, sampled=True) == 312 + 80
    assert decode_weight_bytes(args, torch.bfloat16) == (156 + 40) * 2


def test_model_cost_of_smollm2_135m_matches_peers_figures() -> None:
    args = smollm2_135m()
    assert flops_per_token(args, sampled=False) == 212_406_912        # "about 212 MFLOP"
    assert lm_head_params(args) == 576 * 49152
    assert decode_weight_bytes(args, torch.float32) == 538_060_032    # "538 MB in fp32"
    assert decode_weight_bytes(args, torch.bfloat16) == 269_030_016   # "269 MB in bf16"


def test_request_flops_counts_lm_head_only_where_a_token_is_sampled() -> None:
    args = smollm2_135m()
    dense, head = flops_per_token(args, sampled=False), 2 * lm_head_params(args)
    assert request_flops(args, 10, 5) == (10 + 5 - 1) * dense + 5 * head
    assert workload_flops(args, [(10, 5), (3, 1)]) == request_flops(args, 10, 5) + request_flops(args, 3, 1)


# ---- HF peer -------------------------------------------------------------------------------------
def test_hf_peer_counts_useful_tokens_while_batches_run_to_their_longest(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagoda.bench.hf_peer import run_hf_peer

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    reqs = [BenchRequest([5, 6, 7], 3), BenchRequest([8], 6), BenchRequest([9, 10], 2)]
    res = run_hf_peer(str(tmp_path), reqs, torch.float32, batch_size=2)
    assert res.useful_output_tokens == 11
    assert res.generated_tokens == 2 * 6 + 1 * 2   # batch [3, 6] runs both rows to 6; batch [2] to 2
    assert res.elapsed_s > 0 and math.isfinite(res.output_tok_s)


def test_roofline_measurements_are_positive_on_small_sizes() -> None:
    assert measure_matmul_flops(torch.float32, n=64, reps=2) > 0
    assert measure_read_bandwidth(nbytes=1 << 20, reps=2) > 0


# ---- end to end ----------------------------------------------------------------------------------
def test_bench_throughput_cli_on_a_tiny_model_with_hf_compare_and_batch1(tmp_path: Path,
                                                                          tiny_llama_byte_tokenizer: Path) -> None:
    from pagoda.entrypoints.cli import main

    model = tiny_llama_byte_tokenizer
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", str(model), "--num-prompts", "5", "--input-len-range", "8", "32",
               "--output-len-range", "4", "12", "--no-roofline", "--dtype", "float32", "--kv-cache-memory", "32MiB",
               "--compare", "hf",
               "--batch1-decode", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    ours, peer = report["pagoda"], report["peers"]["hf"]
    assert ours["num_requests"] == 5 and 20 <= ours["output_tokens"] <= 60
    assert peer["useful_output_tokens"] == ours["output_tokens"]
    assert peer["ratio"] > 0 and peer["output_tok_s"] > 0
    assert report["batch1_decode"]["output_tokens"] == 128 and report["batch1_decode"]["decode_tok_s"] > 0
    assert "roofline" not in report


@pytest.mark.slow
def test_bench_throughput_cli_writes_positive_figures(tmp_path: Path) -> None:
    from pagoda.entrypoints.cli import main
    from pagoda.model.default_model import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("default model not installed")

    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--num-prompts", "4", "--input-len-range", "8", "16",
               "--output-len-range", "4", "8", "--no-roofline", "--dtype", "float32", "--kv-cache-memory", "256MiB",
               "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    ours = report["pagoda"]
    assert report["workload"]["num_prompts"] == 4
    assert 16 <= ours["output_tokens"] <= 32
    assert all(ours[k] > 0 for k in ("elapsed_s", "requests_s", "output_tok_s", "total_tok_s"))
    assert ours["total_tok_s"] > ours["output_tok_s"]
