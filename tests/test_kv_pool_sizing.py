"""The KV pool: sized by what max_num_seqs x max_model_len can use (capped by free RAM), allocated
lazily so RSS follows the tokens cached, and never read where nothing was written."""
from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

import pagoda.config as config
from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig

GiB = 1 << 30


def _available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(config.psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes))


def test_pool_is_what_the_sequences_can_use_when_memory_allows(monkeypatch):
    _available(monkeypatch, 64 * GiB)
    assert CacheConfig().pool_bytes(bytes_per_block=1000, blocks_wanted=10) == 10_000


def test_pool_is_capped_by_a_share_of_free_ram_and_by_4_gib(monkeypatch):
    _available(monkeypatch, 4 * GiB)
    assert CacheConfig().pool_bytes(1 << 20, 100_000) == GiB  # 25% of what is available
    _available(monkeypatch, 64 * GiB)
    assert CacheConfig().pool_bytes(1 << 20, 100_000) == 4 * GiB


def test_explicit_kv_cache_memory_is_taken_as_given(monkeypatch):
    _available(monkeypatch, 1 << 20)
    assert CacheConfig(kv_cache_memory="2GiB").pool_bytes(1000, 1) == 2 * GiB
    with pytest.raises(ValueError, match="kv_cache_memory"):
        CacheConfig(kv_cache_memory=0).pool_bytes(1000, 1)


def test_engine_pool_holds_every_sequence_at_full_context(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", max_num_seqs=3, max_model_len=70, block_size=16)
    assert llm.engine.kv.pool.num_blocks == 3 * 5  # ceil(70 / 16) blocks per sequence


def test_pool_allocation_is_lazy_rss_follows_use(tiny_llama, default_gguf):
    """A 512 MiB pool costs no resident memory until tokens are written into it."""
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", kv_cache_memory="1MiB")
    runner = llm.engine.runner
    blocks = (512 << 20) // runner.kv_bytes_per_block()
    rss = psutil.Process().memory_info().rss
    runner.allocate_kv_cache(blocks)
    grown = psutil.Process().memory_info().rss - rss
    assert grown < (64 << 20), f"allocating the pool made {grown / 2**20:.0f} MiB resident"


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8")])
def test_generation_never_reads_unwritten_kv_slots(tiny_llama, default_gguf, dtype, kv_cache_dtype):
    """torch.empty leaves whatever was in memory: fill the pool with NaN and the output must not change."""
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=4,
              kv_cache_memory="4MiB", enable_prefix_caching=False)
    prompts = [[5, 6, 7], list(range(10, 27)), [3] * 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for k, v in llm.engine.runner.kv_caches + llm.engine.runner.kv_scales:
        for t in (k, v):
            t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)  # -1: NaN bits in bf16 words
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_engine_logs_the_pool_size_and_why(tiny_llama, default_gguf, caplog):
    with caplog.at_level("INFO", logger="pagoda.engine.engine"):
        LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", max_num_seqs=2, max_model_len=32, block_size=16)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:"))
    assert "4 blocks" in line and "2 seqs x 32 tokens" in line

