"""Mixture of experts: Mixtral and Qwen3-MoE from transformers configs, and the C++ experts op.

The tiny models (tiny_models.build_tiny_moe) have 8 experts with top-2 routing; Qwen3-MoE renormalizes its top-2
(norm_topk_prob), has per-head q/k norms and a dense middle layer (mlp_only_layers). With random weights of
std 0.2 the router's choices differ from token to token, so a wrong routing rule, a swapped expert or a wrong
weight moves the greedy tokens within a few steps.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import (
    GGUF_LAYER,
    add_gguf_hparams,
    build_tiny_moe,
    finish_gguf,
    gguf_tensor_name,
    greedy_tokens,
    hf_argmax_agreement,
    hf_greedy,
    variant,
    with_architecture,
    worst_prompt_logprob_error,
)

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu_extension import build_isa, kernel_available
from pagoda.kernels.fused_ops import silu_and_mul
from pagoda.kernels.policy import TORCH_ONLY, KernelPolicy
from pagoda.layers.moe import SparseMoeBlock, moe_reference, route
from pagoda.quantization.methods import quantize_weight

NEW = 24
PROMPTS = [[5, 17, 99, 3, 250], list(range(10, 47)), [7], list(range(100, 300, 3)), [400, 401, 402, 11, 12, 13]]
ARCHS = ["mixtral", "qwen3_moe"]

# The experts op runs where every expert linear has a C++ kernel: AVX-512 builds (bf16: AVX512-BF16).
needs_kernels = pytest.mark.skipif(not (kernel_available() and build_isa().avx512),
                                   reason="no AVX-512 build of the C++ kernels")


@pytest.fixture(scope="module", params=ARCHS)
def tiny_moe(request, tmp_path_factory) -> str:
    return str(build_tiny_moe(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param))


@pytest.fixture(scope="module")
def hf_tokens(tiny_moe) -> list[list[int]]:
    return hf_greedy(tiny_moe, PROMPTS, NEW)


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS, n: int = 1) -> list[list[int]]:
    return greedy_tokens(llm, prompts, NEW, n)


def test_the_tiny_models_are_sparse_as_configured(tiny_moe, default_gguf):
    from pagoda.model.llama import LlamaMLP

    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    kinds = [type(layer.mlp) for layer in model.layers]
    qwen = model.args.architecture == "Qwen3MoeForCausalLM"
    assert kinds == ([SparseMoeBlock, LlamaMLP, SparseMoeBlock] if qwen else [SparseMoeBlock] * 2)
    block = model.layers[0].mlp
    assert len(block.experts) == 8 and block.top_k == 2 and block.renormalize
    assert model.stack is None  # the C++ decoder stack runs dense layers only
    if kernel_available() and build_isa().avx512:
        assert block.op is not None  # the experts run as one op


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tiny_moe_greedy_matches_hf(tiny_moe, default_gguf, hf_tokens, kernels):
    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", kernels=kernels, kv_cache_memory="16MiB")
    assert generate(llm) == hf_tokens


def test_tiny_moe_with_chunked_prefill_in_small_blocks_matches_hf(tiny_moe, default_gguf, hf_tokens):
    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", max_num_batched_tokens=16, block_size=4,
              kv_cache_memory="16MiB")
    assert generate(llm) == hf_tokens


def test_tiny_moe_prefix_cache_hits_give_the_same_tokens(tiny_moe, default_gguf, hf_tokens):
    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", block_size=4, enable_prefix_caching=True,
              kv_cache_memory="16MiB")
    for _ in range(2):  # the second pass reads the prompts' full blocks from the cache
        assert generate(llm) == hf_tokens
    outs = llm.generate(PROMPTS[3:4], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert outs[0].num_cached_tokens >= len(PROMPTS[3]) - 4


def test_tiny_moe_preempted_requests_resume_with_identical_tokens(tiny_moe, default_gguf, hf_tokens):
    # 24 blocks of 4 tokens hold the longest sequence (91 tokens) but not all five at once.
    cfg = json.loads((Path(tiny_moe) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 4 * head_dim * 4  # K and V, fp32
    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", block_size=4, kv_cache_memory=24 * per_block)
    assert llm.engine.kv.pool.num_blocks == 24
    assert generate(llm) == hf_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.pool.num_free == 24


def test_tiny_moe_parallel_samples_are_each_greedy(tiny_moe, default_gguf, hf_tokens):
    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", block_size=4, kv_cache_memory="16MiB")
    assert generate(llm, n=3) == [ref for ref in hf_tokens for _ in range(3)]


def agreement_with_hf(model: str, default_gguf: str, prompt: list[int], hf_dir: str | None = None,
                      expert_format: str | None = None, **kw) -> float:
    """Teacher-forced argmax agreement of `model` with transformers fp32 (on `hf_dir`, else `model`) over `prompt`
    (Pagoda's rank-1 prompt logprobs). `expert_format`: the format every expert's quantized weights must have."""
    llm = LLM(model, tokenizer=default_gguf, block_size=4, max_num_batched_tokens=32, kv_cache_memory="16MiB", **kw)
    if kw.get("quantization"):
        block = llm.engine.runner.model.layers[0].mlp
        packed = [lin.qweight for e in block.experts for lin in (e.gate_up_proj, e.down_proj)]
        assert all(pw is not None and pw.format == (expert_format or pw.format) for pw in packed)
        assert block.gate.weight.is_floating_point()  # the router is never quantized
        assert block.op is not None or not build_isa().avx512  # quantized experts run in the op too
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return hf_argmax_agreement(hf_dir or model, prompt, out.prompt_logprobs)


LONG = [(7 * i) % 500 + 3 for i in range(130)]


def test_tiny_moe_fp32_agrees_with_hf_on_every_position(tiny_moe, default_gguf):
    assert agreement_with_hf(tiny_moe, default_gguf, LONG, dtype="float32") == 1.0


@pytest.mark.parametrize("dtype,quantization,floor", [("bfloat16", None, 0.9), ("float32", "int8", 0.8),
                                                      ("bfloat16", "int8", 0.8), ("float32", "int4", 0.2),
                                                      ("bfloat16", "int4", 0.2)])
def test_tiny_moe_bf16_and_quantized_experts_follow_hf(tiny_moe, default_gguf, dtype, quantization, floor):
    """Rounding moves these random logits (int4 RTN on N(0, 0.2) weights most, in every linear, and a moved router
    logit picks other experts), but a wiring error stays below 0.1 in fp32: each layer's experts in reverse order
    or every expert's gate and up swapped."""
    assert agreement_with_hf(tiny_moe, default_gguf, LONG, dtype=dtype, quantization=quantization,
                             quantization_group_size=32) >= floor


def test_qwen3_moe_without_norm_topk_prob_matches_hf(default_gguf, tmp_path):
    """Qwen3-MoE's top-k weights sum to less than one unless norm_topk_prob; its dense layer also by
    decoder_sparse_step (layer 0 of 2 here) rather than mlp_only_layers."""
    path = str(build_tiny_moe(tmp_path / "q", "qwen3_moe", norm_topk_prob=False, num_hidden_layers=2,
                              mlp_only_layers=[], decoder_sparse_step=2))
    llm = LLM(path, tokenizer=default_gguf, dtype="float32", kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    assert not isinstance(model.layers[0].mlp, SparseMoeBlock) and isinstance(model.layers[1].mlp, SparseMoeBlock)
    assert not model.layers[1].mlp.renormalize
    assert generate(llm, PROMPTS[:3]) == hf_greedy(path, PROMPTS[:3], NEW)


def test_other_moe_architectures_are_refused_by_name(tiny_moe, default_gguf, tmp_path):
    folder = with_architecture(tiny_moe, tmp_path / "other", "DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="unsupported architecture 'DeepseekV3ForCausalLM'.*MixtralForCausalLM"):
        LLM(folder, tokenizer=default_gguf)


def test_top_k_beyond_the_experts_is_refused(tiny_moe, tmp_path):
    from pagoda.model.errors import ModelFileError

    folder = variant(tiny_moe, tmp_path / "bad", num_experts_per_tok=9)
    with pytest.raises(ModelFileError, match="num_experts_per_tok = 9"):
        LLM(folder)


# ---- the experts op against the per-expert reference ---------------------------------------------------------


def moe_block(quantization: str | None, num_experts: int = 8, hidden: int = 64, inter: int = 96,
              seed: int = 0) -> SparseMoeBlock:
    """An fp32 block with N(0, 0.2) weights, its experts quantized by `quantization` (groups of 32)."""
    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, inter, num_experts, top_k=2, renormalize=True)
    for p in block.parameters():
        p.data.normal_(0.0, 0.2)
    if quantization:
        for e in block.experts:
            for lin in (e.gate_up_proj, e.down_proj):
                lin.set_quantized(quantize_weight(quantization, lin.weight.detach(), 32))
    return block


def prepared(block: SparseMoeBlock, dtype: torch.dtype, policy: KernelPolicy) -> SparseMoeBlock:
    """A copy of `block` in `dtype` whose experts chose their kernels under `policy` (as a model's prepare())."""
    block = copy.deepcopy(block)
    for p in block.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)
    for e in block.experts:
        e.gate_up_proj.prepare(dtype, policy)
        e.down_proj.prepare(dtype, policy)
    block.bind_ops(policy.cpp)
    block.prepare_experts(policy)
    return block


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_op_equals_the_per_expert_reference_at_every_row_count(dtype, quantization):
    if dtype == torch.bfloat16 and not build_isa().avx512_bf16:
        pytest.skip("bf16 linears need AVX512-BF16")
    block = moe_block(quantization)
    kernels, torch_ref = prepared(block, dtype, KernelPolicy(cpp=True)), prepared(block, dtype, TORCH_ONLY)
    assert kernels.op is not None and torch_ref.op is None
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, 65):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        weights, ids = route(F.linear(x, kernels.gate.weight), 2, True)
        out = kernels.op(x, ids, weights)
        # The same kernels one expert at a time in torch: the same sums in the same order, bit for bit.
        assert torch.equal(out, moe_reference(x, ids, weights, kernels.experts, silu_and_mul)), rows
        # Torch's own matmuls on the (dequantized) weights: fp32 to rounding, bf16 to its 8-bit mantissa.
        ref = moe_reference(x, ids, weights, torch_ref.experts)
        err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (rows, err)
        assert torch.equal(kernels(x), out)  # the block routes and calls the op


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_experts_output_does_not_depend_on_the_other_tokens_of_the_step(dtype):
    """Given its routing, a token's output is the same bits alone or among 40 tokens: its experts' kernels compute
    each row on its own, and its k rows are summed in slot order. (The router's logits are torch's F.linear, as
    in transformers; oneDNN's fp32 GEMM rounds one row alone differently from one among many.)"""
    if dtype == torch.bfloat16 and not build_isa().avx512_bf16:
        pytest.skip("bf16 linears need AVX512-BF16")
    block = prepared(moe_block(None), dtype, KernelPolicy(cpp=True))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, ids = route(F.linear(x, block.gate.weight), 2, True)
    whole = block.op(x, ids, weights)
    for i in range(40):
        assert torch.equal(block.op(x[i: i + 1], ids[i: i + 1], weights[i: i + 1])[0], whole[i]), i


def test_routing_is_softmax_then_top_k_then_renormalized_in_fp32():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16)
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(torch.tensor([1.0, 3.0, 2.0, 0.0]), -1)
    assert ids.tolist() == [[1, 2]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights[0], probs[[1, 2]] / probs[[1, 2]].sum())


# ---- GGUF, as llama.cpp's converter writes these models ------------------------------------------------------


def write_moe_gguf(hf_dir: Path, path: Path, expert_type: str = "F32") -> Path:
    """The HF folder as llama.cpp's convert_hf_to_gguf.py writes it: Mixtral as arch llama with expert_count (q and
    k rows permuted for its rotary layout), Qwen3-MoE as arch qwen3moe; the router as ffn_gate_inp and each
    layer's experts stacked per projection, ffn_{gate,up,down}_exps [E, rows, cols], in `expert_type` (F32, Q8_0
    or Q4_0, as llama-quantize leaves them); everything else F32."""
    import gguf
    import numpy as np
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    mixtral = cfg["architectures"] == ["MixtralForCausalLM"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama" if mixtral else "qwen3moe")
    add_gguf_hparams(w, cfg)
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])  # transformers 5 writes the latter
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if not mixtral:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])

    def permute(t: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    layer = GGUF_LAYER | {"block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp"}  # the router
    stacked = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
               "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = np.ascontiguousarray(t.float().numpy())
        if ".experts." in name:  # model.layers.I.<block>.experts.E.<proj>.weight
            i = name.removeprefix("model.layers.").split(".", 1)[0]
            e, proj, _ = name.split(".experts.")[1].split(".")
            experts.setdefault(f"blk.{i}.{stacked[proj]}.weight", {})[int(e)] = a
            continue
        if mixtral and ".self_attn.q_proj." in name:
            a = permute(a, heads)
        elif mixtral and ".self_attn.k_proj." in name:
            a = permute(a, kv_heads)
        w.add_tensor(gguf_tensor_name(name, layer), a)
    for gname, per in experts.items():
        a = np.stack([per[e] for e in range(len(per))])
        if expert_type == "F32":
            w.add_tensor(gname, a)
        else:
            qtype = gguf.GGMLQuantizationType[expert_type]
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)  # the byte shape: gguf-py derives the rest
    finish_gguf(w)
    return path


@pytest.fixture(scope="module")
def all_sparse_moe(request, tmp_path_factory) -> str:
    """The tiny models with every layer sparse (llama.cpp's qwen3moe has no dense layers)."""
    arch = request.param
    extra = {"mlp_only_layers": []} if arch == "qwen3_moe" else {}
    return str(build_tiny_moe(tmp_path_factory.mktemp(f"sparse_{arch}"), arch, **extra))


@pytest.mark.parametrize("all_sparse_moe", ARCHS, indirect=True)
def test_tiny_moe_gguf_as_llama_cpp_writes_it_matches_hf(all_sparse_moe, default_gguf, tmp_path):
    from pagoda.model.loader import resolve_model_files

    hf = Path(all_sparse_moe)
    path = write_moe_gguf(hf, tmp_path / "moe.gguf")
    cfg = resolve_model_files(str(path)).hf_config
    assert cfg["architectures"] == json.loads((hf / "config.json").read_text())["architectures"]
    llm = LLM(str(path), tokenizer=default_gguf, dtype="float32", max_num_batched_tokens=16, block_size=4,
              kv_cache_memory="16MiB")
    assert generate(llm, PROMPTS[:3]) == hf_greedy(all_sparse_moe, PROMPTS[:3], NEW)


@pytest.mark.parametrize("all_sparse_moe", ARCHS, indirect=True)
@pytest.mark.parametrize("expert_type,floor", [("Q8_0", 0.9), ("Q4_0", 0.4)])
def test_tiny_moe_gguf_with_quantized_experts_runs_them_in_their_blocks(all_sparse_moe, default_gguf, tmp_path,
                                                                         expert_type, floor):
    """quantization="gguf" keeps Q8_0 / Q4_0 experts in their blocks (INT8 / INT4, groups of 32) for the kernels."""
    path = write_moe_gguf(Path(all_sparse_moe), tmp_path / "moe.gguf", expert_type)
    fmt = "int8" if expert_type == "Q8_0" else "int4"
    agree = agreement_with_hf(str(path), default_gguf, LONG, hf_dir=all_sparse_moe, expert_format=fmt,
                              dtype="float32", quantization="gguf")
    assert agree >= floor


def test_the_roofline_counts_the_active_parameters_of_a_moe_model(tiny_moe):
    """bench's batch-1 decode bytes and FLOPs count the router and the top-k experts of a sparse layer."""
    from safetensors.torch import load_file

    from pagoda.bench.roofline import non_embedding_params
    from pagoda.model.args import ModelArgs

    args = ModelArgs.from_hf_config(json.loads((Path(tiny_moe) / "config.json").read_text()))
    tensors = load_file(str(Path(tiny_moe) / "model.safetensors"))
    total = sum(t.numel() for name, t in tensors.items() if name not in ("model.embed_tokens.weight", "lm_head.weight"))
    idle = sum(t.numel() for name, t in tensors.items() if ".experts." in name) * (8 - 2) // 8
    assert non_embedding_params(args) == total - idle


def test_moe_prompt_logprobs_match_hf(tiny_moe, default_gguf):
    """fp32 on both sides: routing and experts in another order (tokens grouped by expert, chunked prefill) give
    float rounding only (measured a few 1e-6); a token routed to another expert moves its logprobs by far more."""
    prompt = PROMPTS[3]
    llm = LLM(tiny_moe, tokenizer=default_gguf, dtype="float32", max_num_batched_tokens=16, kv_cache_memory="16MiB")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert worst_prompt_logprob_error(tiny_moe, prompt, out.prompt_logprobs) < 1e-4


# ---- GLM-4.5 (Glm4Moe): grouped sigmoid routing, shared experts --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory) -> str:
    return str(build_tiny_moe(tmp_path_factory.mktemp("tiny_glm"), "glm4_moe"))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tiny_glm4_moe_greedy_matches_hf(tiny_glm, default_gguf, kernels):
    """Its MTP layer (layers.3) is in the file and skipped by the target, as transformers skips it."""
    llm = LLM(tiny_glm, tokenizer=default_gguf, dtype="float32", kernels=kernels, block_size=4,
              max_num_batched_tokens=16, kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    assert len(model.layers) == 3 and model.args.num_mtp_layers == 1
    block = model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.shared_experts is not None and block.grouped is not None
    assert generate(llm, PROMPTS[:4]) == hf_greedy(tiny_glm, PROMPTS[:4], NEW)
    assert agreement_with_hf(tiny_glm, default_gguf, LONG, dtype="float32") == 1.0


def test_grouped_routing_is_transformers_glm4_moe_router():
    """Experts and weights of route_grouped against Glm4MoeTopkRouter over random logits, with a bias that moves
    the choice away from the plain top scores and groups that exclude some of them."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from pagoda.layers.moe import GroupedRouting, route_grouped

    cfg = Glm4MoeConfig(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True)
    router = Glm4MoeTopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 16)
    _, want_w, want_ids = router(x)
    w, ids = route_grouped(F.linear(x, router.weight), router.e_score_correction_bias, 4, True,
                           GroupedRouting(4, 2, 2.5))
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))
    plain = route_grouped(F.linear(x, router.weight), torch.zeros(16), 4, True, GroupedRouting(1, 1, 2.5))[1]
    assert not torch.equal(plain.sort(dim=-1).values, order.values)  # the bias and groups changed choices
