"""Batch invariance (issue 21): a request's logprobs do not depend on what else is in the batch.

First each linear kernel a layer can run: a row's result is the same bits whatever the other rows of the call.
Then the engine: a needle prompt runs alone and among other prompts of varied lengths and output lengths, under
several token budgets (max_num_batched_tokens: the needle's prefill is chunked differently and shares its steps
with other prefills and decodes, so every linear sees it among 1 to 2048 rows). Its prompt logprobs and the
logprobs of its greedy tokens must be bit-identical every time (torch.equal), for every dtype, weight format and
kernel set. The tiny random model covers the matrix; SmolLM2's GGUF (Q4_1 layers, a Q8_0 head of 49152 rows) the
formats as they are served. `-m slow` runs SmolLM2 over the whole matrix; `--kernels avx2`
(tests/test_kernels_avx2.py) runs this file on the avx2 build.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu_extension import kernel_available

# (max_num_batched_tokens, other prompts in the batch): the first is the reference, the needle alone.
RUNS = [(2048, 0), (64, 0), (64, 8), (512, 8), (512, 40), (2048, 40)]
# dtype, quantization ("gguf": the file's blocks as stored), quant_activations
FORMATS = [(dtype, quant, "float") for dtype in ("float32", "bfloat16") for quant in (None, "int4", "int8", "fp8")] \
    + [("float32", "int4", "int8"), ("bfloat16", "int4", "int8")]


# ---- each linear kernel: a row's bits do not depend on the other rows of the call ---------------------------------

ROW_COUNTS = [1, 2, 3, 8, 9, 17, 64, 130]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("fmt", ["dense", "int4", "int4-g64-sym", "int8", "int8-g32", "fp8", "int4-a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 40])  # panels of 16 columns, and a shape they can't take
def test_every_linear_kernel_sums_a_row_alike_at_every_row_count(n, dtype, fmt, kernels):
    """The kernel record a layer runs (choose_linear_kernel), at K = 1536 (where oneDNN's K blocking changes between
    one row and more): rows of x[:m] equal the same rows computed alone, bit for bit."""
    from pagoda.kernels.linear_kernel import choose_linear_kernel
    from pagoda.kernels.policy import KernelPolicy
    from pagoda.kernels.quant_linear import PackedWeight
    from pagoda.quantization.methods import quantize_weight

    torch.manual_seed(n)
    k = 1536
    w, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    weight = qweight = None
    if fmt == "dense":
        weight, bias = w.to(dtype), bias.to(dtype)
    elif fmt.startswith("int4"):
        qweight = quantize_weight("int4", w, 64 if "g64" in fmt else 32)
        if "sym" in fmt:
            qweight = PackedWeight("int4", qweight.data, qweight.scales, None, 64, k)
    elif fmt == "int8-g32":  # GGUF Q8_0's grid
        q = quantize_weight("int8", w)
        qweight = PackedWeight("int8", q.data, torch.rand(n, k // 32) / 64 + 1e-3, None, 32, k)
    else:
        qweight = quantize_weight(fmt, w)
    policy = KernelPolicy.resolve(kernels, "int8" if fmt == "int4-a8" else "float")
    run = choose_linear_kernel(weight, qweight, bias, dtype, policy).run
    x = torch.randn(max(ROW_COUNTS), k).to(dtype)
    alone = torch.cat([run(x[i:i + 1]) for i in range(len(x))])
    for m in ROW_COUNTS:
        assert torch.equal(run(x[:m]), alone[:m]), f"{m} rows"


# ---- the engine: a needle prompt alone and among others ---------------------------------------------------------


def _prompts(vocab: int, others: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(0)
    needle = [rng.randrange(3, vocab) for _ in range(97)]  # split by a budget of 64, whole in 512
    return needle, [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 180))] for _ in range(others)]


def _needle_logprobs(llm: LLM, needle: list[int], others: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """The needle's logprobs (prompt positions, then its greedy tokens: each position's top 5 and its own token,
    by token id) and those token ids, run with the others around it (half before, half after)."""
    want = SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    half = len(others) // 2
    params = [SamplingParams(max_tokens=4 + i % 13, temperature=0, ignore_eos=True) for i in range(len(others))]
    outs = llm.generate([*others[:half], needle, *others[half:]], [*params[:half], want, *params[half:]],
                        use_tqdm=False)
    out = outs[half]
    positions = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
    entries = [sorted((tid, lp.logprob) for tid, lp in entry.items()) for entry in positions]
    return torch.tensor([lp for e in entries for _, lp in e], dtype=torch.float64), \
        [[tid for tid, _ in e] for e in entries]


def assert_batch_invariant(model: str | None, vocab: int, runs: list[tuple[int, int]] = RUNS, **engine) -> None:
    needle, others = _prompts(vocab, max(n for _, n in runs))
    llm = LLM(model, kv_cache_memory="64MiB", max_num_batched_tokens=max(b for b, _ in runs), max_num_seqs=64,
              enable_prefix_caching=False, **engine)
    ref = None
    for budget, n in runs:
        # One engine for every budget (building one per budget tripled the file's time): the scheduler reads its
        # budget afresh each step, and no buffer is sized by it.
        llm.engine.config.scheduler.max_num_batched_tokens = budget
        lps, ids = _needle_logprobs(llm, needle, others[:n])
        if ref is None:
            ref = lps, ids
            continue
        where = f"budget {budget}, {n} others ({engine})"
        assert ids == ref[1], f"{where}: other tokens or top-5 than alone"
        assert torch.equal(lps, ref[0]), f"{where}: logprobs up to {(lps - ref[0]).abs().max().item():.3g} off alone"


@pytest.fixture(scope="module")
def tiny(tiny_llama, default_gguf) -> tuple[str, dict]:
    return tiny_llama, {"tokenizer": default_gguf}


def _quant_kernels() -> bool:
    """Whether the loaded build has the quantized linear kernels (every build does: the row-major kernel is
    portable vector code)."""
    return kernel_available() and torch.ops.pagoda.quant_linear_supported(64, 64)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("dtype,quantization,quant_activations", FORMATS)
def test_tiny_model_logprobs_do_not_depend_on_the_batch(tiny, dtype, quantization, quant_activations, kernels,
                                                        request):
    if kernels == "torch" and (quant_activations == "int8" or request.config.getoption("--kernels") != "auto"):
        pytest.skip("int8 activations are a C++ kernel's; the torch paths run once, in the default session")
    if not _quant_kernels() and (quantization in ("int8", "fp8") or quant_activations == "int8"):
        pytest.skip("the C++ kernels did not build: the torch paths dequantize every format alike")
    model, kw = tiny
    assert_batch_invariant(model, 512, dtype=dtype, quantization=quantization, quant_activations=quant_activations,
                           kernels=kernels, **kw)


# SmolLM2 as served: its Q4_1 layers (the panel kernel in bf16, the row-major one in fp32) and its Q8_0 head.
SMOLLM_RUNS = [(2048, 0), (64, 0), (64, 8), (512, 8)]


@pytest.mark.skipif(not _quant_kernels(), reason="the quantized kernels' paths; the torch ones run on the tiny model")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm_gguf_logprobs_do_not_depend_on_the_batch(default_gguf, dtype):
    assert_batch_invariant(None, 49152, SMOLLM_RUNS, dtype=dtype, quantization="gguf")


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("dtype,quantization,quant_activations",
                         FORMATS + [("float32", "gguf", "float"), ("bfloat16", "gguf", "float")])
def test_smollm_logprobs_do_not_depend_on_the_batch_exhaustive(default_gguf, dtype, quantization, quant_activations,
                                                               kernels):
    if kernels == "torch" and quant_activations == "int8":
        pytest.skip("int8 activations are a C++ kernel's")
    assert_batch_invariant(None, 49152, dtype=dtype, quantization=quantization, quant_activations=quant_activations,
                           kernels=kernels)


def test_importing_pagoda_keeps_onednn_off_its_batch_variant_amx_kernels():
    """oneDNN's AMX bf16 matmul (the prepacked one Pagoda runs) sums a row differently at 130 rows than alone;
    importing pagoda first caps oneDNN at AVX512-BF16 (on a CPU without AMX the check holds anyway). A cap the user
    set is kept."""
    import os
    import subprocess
    import sys

    code = ("import os, torch, pagoda\n"
            "from pagoda.kernels.linear import onednn_linear, prepack\n"
            "torch.manual_seed(48)\n"
            "w = prepack((torch.randn(48, 1536) / 1536**0.5).bfloat16()); b = torch.randn(48).bfloat16()\n"
            "x = torch.randn(130, 1536).bfloat16()\n"
            "rows = torch.cat([onednn_linear(x[i:i + 1], w, b) for i in range(130)])\n"
            "print(os.environ['ONEDNN_MAX_CPU_ISA'], all(torch.equal(onednn_linear(x[:m], w, b), rows[:m])\n"
            "                                            for m in (64, 130)))\n")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["AVX512_CORE_BF16", "True"], out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", code], env={**env, "ONEDNN_MAX_CPU_ISA": "AVX2"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[0] == "AVX2", out.stdout + out.stderr
