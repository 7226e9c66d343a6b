"""Greedy generation equals HF transformers token for token in float32, on the same weights."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import add_gguf_hparams, finish_gguf, gguf_tensor_name, hf_greedy

from pagoda import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250], list(range(10, 47)), [7], [400, 401, 402, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           list(range(100, 300, 3))]


def run(model_dir: str, default_gguf: str, max_new: int, **kw) -> list[list[int]]:
    llm = LLM(model_dir, tokenizer=default_gguf, dtype="float32", **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_llama(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, 24)


@pytest.fixture(scope="module")
def hf_qwen2(tiny_qwen2):
    return hf_greedy(tiny_qwen2, PROMPTS, 24)


def test_tiny_qwen3_with_per_head_qk_norms_matches_hf(tiny_qwen3, default_gguf):
    """Qwen3: RMSNorm over each q and k head before RoPE, head_dim apart from hidden / heads."""
    want = hf_greedy(tiny_qwen3, PROMPTS, 24)
    assert run(tiny_qwen3, default_gguf, 24) == want
    assert run(tiny_qwen3, default_gguf, 24, max_num_batched_tokens=16, block_size=4) == want  # chunked prefill
    # The same weights as llama.cpp's converter writes a Qwen3 GGUF (F32, rows as in HF: no Q/K permute).
    gguf_path = _write_qwen3_gguf(Path(tiny_qwen3), Path(tiny_qwen3) / "tiny-qwen3.gguf")
    assert run(str(gguf_path), default_gguf, 24) == want


def _write_qwen3_gguf(hf_dir: Path, path: Path) -> Path:
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_gguf_hparams(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        w.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(t.float().numpy()))
    finish_gguf(w)
    return path


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tiny_llama_greedy_matches_hf(tiny_llama, default_gguf, hf_llama, kernels):
    assert run(tiny_llama, default_gguf, 24, kernels=kernels) == hf_llama


def test_torch_kernels_setting_keeps_every_layer_off_the_cpp_kernels(tiny_llama, default_gguf):
    from pagoda.kernels import fused_ops
    from pagoda.kernels import paged_attention as pa
    from pagoda.layers.linear import Linear

    model = LLM(tiny_llama, tokenizer=default_gguf, dtype="bfloat16", kernels="torch",
                kv_cache_memory="16MiB").engine.runner.model
    assert model.stack is None
    twins = {fused_ops.rms_norm_torch, fused_ops.rope_torch_, fused_ops.silu_and_mul_torch,
             fused_ops.write_kv_cache_torch, pa.paged_attention_reference}
    bound = [getattr(m, a) for m in model.modules() if hasattr(m, "bind_ops")
             for a in ("op", "act", "write_kv", "attend") if getattr(m, a, None) is not None]
    assert bound and all(f in twins for f in bound)
    assert not any(layer.fused for layer in model.attention_layers())
    assert all(m.matmul.panels is None and not m.matmul.cpp for m in model.modules() if isinstance(m, Linear))
    assert model.attention_layers()[0].k_cache.dim() == 4  # K words are the C++ attention's layout
    with pytest.raises(ValueError, match="kernels must be one of auto, native, avx2, torch"):
        LLM(tiny_llama, tokenizer=default_gguf, kernels="cuda")


def test_tiny_qwen2_with_bias_and_tied_embeddings_matches_hf(tiny_qwen2, default_gguf, hf_qwen2):
    assert run(tiny_qwen2, default_gguf, 24) == hf_qwen2


def test_chunked_prefill_small_budget_matches_hf(tiny_llama, default_gguf, hf_llama):
    assert run(tiny_llama, default_gguf, 24, max_num_batched_tokens=16, block_size=4) == hf_llama


def test_preempted_requests_resume_with_identical_tokens(tiny_llama, default_gguf, hf_llama):
    # A pool of 24 blocks x 4 tokens cannot hold all five sequences at once: preemption must occur.
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", block_size=4,
              kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4)
    assert llm.engine.kv.pool.num_blocks == 24
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_llama
    assert llm.engine.kv.pool.num_free == 24


def test_parallel_sampling_shares_prompt_blocks_and_each_sample_is_greedy(tiny_llama, default_gguf, hf_llama):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for out, ref in zip(outs, hf_llama):
        assert len(out.outputs) == 3
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            assert c.token_ids == ref
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_smollm_gguf_greedy_matches_hf(smollm_llm, default_gguf):
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    path = Path(default_gguf)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = smollm_llm.get_tokenizer()
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far away,"]
    outs = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def test_prompt_logprobs_match_hf_log_softmax(tiny_llama, default_gguf):
    from transformers import AutoModelForCausalLM
    prompt = list(range(20, 60))
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", max_num_batched_tokens=16)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        tok = prompt[pos]
        assert tok in entry
        assert abs(entry[tok].logprob - ref[pos - 1, tok].item()) < 1e-4
        top = ref[pos - 1].topk(3)
        for rank, (val, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert abs(entry[tid].logprob - val) < 1e-4
            assert entry[tid].rank == rank


def test_prompt_logprobs_complete_under_chunking_and_preemption(tiny_llama, default_gguf):
    prompts = [list(range(20 + i, 56 + i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    ref = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32").generate(prompts, params, use_tqdm=False)
    small = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", block_size=4, max_num_batched_tokens=8,
                kv_cache_memory=12 * 2048)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == 36
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) < 1e-4
