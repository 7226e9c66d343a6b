"""The kernels' avx2 build (x86-64-v3: AVX2, FMA, F16C, no AVX-512), what CPUs without AVX-512 run, passes the
kernel tests and greedy equality with HF on any x86-64-v3 machine, AVX-512 ones included: each suite runs in a
pytest subprocess that loads that build first (conftest's --kernels avx2), since a process holds one build."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagoda.kernels import cpu_extension
from pagoda.kernels.cpu_features import has_x86_64_v3

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/test_paged_attention.py", "tests/test_fused_ops.py", "tests/test_linear_kernel.py",
                "tests/test_quant_kernels.py", "tests/test_kquants.py", "tests/test_kv_cache_dtype.py",
                "tests/test_batch_invariance.py",
                "tests/test_kernels_avx2.py::test_avx2_build_offers_no_avx512_only_kernels",
                "tests/test_kernels_avx2.py::test_a_process_holds_one_kernel_build"]
# Greedy equals HF fp32 over the tiny Llama, Qwen2 and Qwen3 (prefill, decode, chunked prefill, preemption,
# parallel sampling, prompt logprobs): every kernel the avx2 build has, in ~10 s on 2 cores. SmolLM2's GGUF
# (another ~20 s) runs with `-m slow`.
HF_TESTS = ["tests/test_generation_matches_hf.py", "-k", "not smollm"]

needs_v3 = pytest.mark.skipif(not has_x86_64_v3(), reason="the avx2 build needs an x86-64-v3 CPU")


def run_pytest_avx2(*args: str) -> subprocess.CompletedProcess:
    """`pytest --kernels avx2 ARGS` in a fresh process (the avx2 build compiles there on first use, ~1 min)."""
    return subprocess.run([sys.executable, "-m", "pytest", "--kernels", "avx2", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)


def assert_passed_on_avx2(r: subprocess.CompletedProcess) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "pagoda C++ kernels: avx2 build, kernel set avx2 " in out, out[:2000]  # conftest's header: no fallback


@pytest.mark.long
@needs_v3
def test_kernel_tests_pass_on_the_avx2_build():
    assert_passed_on_avx2(run_pytest_avx2(*KERNEL_TESTS))


@needs_v3
def test_greedy_generation_matches_hf_on_the_avx2_build():
    assert_passed_on_avx2(run_pytest_avx2(*HF_TESTS))


@pytest.mark.slow
@needs_v3
def test_smollm_gguf_greedy_matches_hf_on_the_avx2_build():
    assert_passed_on_avx2(run_pytest_avx2("tests/test_generation_matches_hf.py", "-k", "smollm"))


def test_avx2_build_offers_no_avx512_only_kernels(request):
    """Run by the subprocess above: the build, not the CPU (AVX-512 here), decides which kernels are chosen."""
    if request.config.getoption("--kernels") != "avx2":
        pytest.skip("runs in the --kernels avx2 session (test_kernel_tests_pass_on_the_avx2_build)")
    from pagoda.kernels.linear import panel_pack, small_m_supported
    from pagoda.kernels.linear_kernel import choose_linear_kernel
    from pagoda.kernels.paged_attention import k_cache_shape, k_words_supported
    from pagoda.kernels.policy import KernelPolicy
    from pagoda.quantization.methods import quantize_weight

    isa = cpu_extension.build_isa()
    assert cpu_extension.loaded_build() == "avx2" and {"avx2", "fma", "f16c"} <= isa.features
    assert not isa.avx512 and not isa.avx512_bf16 and "avx512f" not in torch.ops.pagoda.build_isa()
    policy = KernelPolicy.resolve("auto")  # auto takes the build this process loaded
    assert policy.cpp and policy.kernel_set == "avx2" == KernelPolicy.resolve("avx2").kernel_set
    with pytest.raises(RuntimeError, match="already loaded the C\\+\\+ kernels' 'avx2' build"):
        KernelPolicy.resolve("native")
    # The AVX-512-only kernels are absent, and nothing chooses them; the portable panel kernel runs quantized weights,
    # and INT8 activations take the interleaved kernel's vpmaddubsw path.
    assert not torch.ops.pagoda.quant_panels_supported(64, 64) and torch.ops.pagoda.int4x8_supported(64, 64)
    assert torch.ops.pagoda.quant_linear_supported(64, 64)
    assert not k_words_supported(torch.bfloat16, 16, 64) and len(k_cache_shape(4, 2, 16, 64, torch.bfloat16)) == 4
    w = torch.randn(64, 128)
    assert panel_pack(w) is None and panel_pack(w.bfloat16()) is None and not small_m_supported(torch.float32, 128)
    pw = quantize_weight("int4", w, 32)
    for dtype in (torch.float32, torch.bfloat16):
        kernel = choose_linear_kernel(None, pw, None, dtype, KernelPolicy(cpp=True, quant_activations="int8"))
        assert kernel.qweight.layout == "interleave8" and kernel.cpp and kernel.stack_args() is not None
        weight_only = choose_linear_kernel(None, pw, None, dtype, policy)
        assert weight_only.qweight.layout == "vpanels" and weight_only.cpp  # the portable panels, 16 columns
        assert weight_only.qweight.data.shape == (4, 128, 8) and torch.ops.pagoda.vpanel_width() == 16
        x = torch.randn(3, 128, dtype=dtype)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(weight_only.run(x).float(), (x.float() @ pw.dequantize().T), **tol)
        exact = x.float() @ pw.dequantize().T  # INT8 activations: within their rounding (about 1%)
        assert ((kernel.run(x).float() - exact).norm() / exact.norm()).item() < 3e-2
    assert choose_linear_kernel(w, None, None, torch.float32, policy).stack_args() is None  # no decoder stack


def test_a_process_holds_one_kernel_build():
    """Both builds register torch.ops.pagoda.*: the first load decides, and asking for the other one is an error."""
    from pagoda.kernels.policy import KernelPolicy

    if not cpu_extension.kernel_available():
        pytest.skip("C++ kernels unavailable")
    other = "native" if cpu_extension.loaded_build() == "avx2" else "avx2"
    with pytest.raises(RuntimeError, match="already loaded the C\\+\\+ kernels"):
        KernelPolicy.resolve(other)
    assert KernelPolicy.resolve("auto").kernel_set == cpu_extension.build_isa().name
