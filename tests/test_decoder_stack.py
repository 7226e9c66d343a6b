"""The decoder layers as one C++ op (few-row steps) give exactly the layer-by-layer path's results."""
from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu_extension import build_isa, kernel_available
from pagoda.kernels.linear import ANY_M

pytestmark = pytest.mark.skipif(not (kernel_available() and build_isa().avx512),
                                reason="the stack needs the C++ streaming kernels (AVX-512)")

PROMPTS = [{"prompt_token_ids": [5, 9, 33, 100]}, {"prompt_token_ids": list(range(20, 51))},
           {"prompt_token_ids": [7] * 9}]


@pytest.fixture(scope="module")
def tiny_llama_with_bias(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_llama_bias"), "llama", attention_bias=True))


def _run(llm: LLM, params: SamplingParams) -> tuple[list, set[str]]:
    with torch.profiler.profile() as prof:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("model,dtype,quantization,kv_cache_dtype", [
    ("tiny_llama", "float32", None, "auto"),
    ("tiny_llama", "bfloat16", None, "auto"),
    ("tiny_llama_with_bias", "float32", None, "auto"),
    ("tiny_qwen2", "bfloat16", None, "int8"),
    ("tiny_llama", "bfloat16", "int4", "auto"),
    ("tiny_llama", "bfloat16", "int4+int8-activations", "auto"),
    ("tiny_llama", "float32", "int8", "fp8_e4m3"),
    ("tiny_llama", "bfloat16", "fp8", "auto"),
    ("tiny_qwen3", "float32", None, "auto"),       # per-head q/k norms inside the stack
    ("tiny_qwen3", "bfloat16", "int4", "auto"),
])
def test_stack_equals_layer_by_layer(model, dtype, quantization, kv_cache_dtype, default_gguf, request):
    int8_activations = quantization == "int4+int8-activations"
    kw = {"quantization": quantization} if quantization else {}
    if int8_activations:  # the int4x8 layout and its kernel (where the CPU has VNNI)
        kw = {"quantization": "int4", "quant_activations": "int8"}
    llm = LLM(request.getfixturevalue(model), tokenizer=default_gguf, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              max_num_seqs=4, **kw)
    net = llm.engine.runner.model
    if int8_activations and torch.ops.pagoda.int4x8_supported(64, 64):
        assert net.layers[0].mlp.down_proj.qweight.layout == "interleave8"
    stack = net.stack
    down = net.layers[0].mlp.down_proj
    if quantization == "int4" and dtype == "bfloat16" and not int8_activations \
            and torch.ops.pagoda.quant_panels_supported(64, 64):
        assert (down.qweight.format, down.qweight.layout) == ("int4", "panels16")
    # Panel-packed and quantized weights: one kernel at every row count, so every step, prefill too.
    assert stack is not None and stack.max_rows == ANY_M
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    fused, ops = _run(llm, params)
    assert "pagoda::decoder_stack" in ops  # decode steps (3 rows) went through it
    net.stack = None
    reference, ops = _run(llm, params)
    assert "pagoda::decoder_stack" not in ops
    # Same kernels in the same order: token ids and logprobs agree exactly, not to a tolerance.
    assert fused == reference


def test_prefill_steps_run_in_the_stack_too(tiny_llama, default_gguf):
    """The row-major quantized kernels (here int8, fp32 activations) run every row count, so the stack does."""
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", quantization="int8")
    with torch.profiler.profile() as prof:  # one 40-token prefill step
        llm.generate([{"prompt_token_ids": list(range(3, 43))}], SamplingParams(max_tokens=1), use_tqdm=False)
    ops = {e.key for e in prof.key_averages()}
    assert "pagoda::decoder_stack" in ops and "pagoda::quant_dequantize" not in ops
