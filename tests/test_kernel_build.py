"""Building and loading the C++ kernels: the install's prebuilt library, and the just-in-time fallback that a
killed or failed build can never leave hanging or silently slow."""
from __future__ import annotations

import importlib.machinery
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagoda.kernels import build_spec, cpu_extension

# A one-op library under its own namespace, so a test process can load it beside Pagoda's kernels.
TINY_CPP = textwrap.dedent("""
    #include <torch/library.h>
    #include <ATen/ATen.h>
    at::Tensor twice(const at::Tensor& x) { return x * 2; }
    TORCH_LIBRARY(pagoda_build_test, m) { m.def("twice(Tensor x) -> Tensor"); }
    TORCH_LIBRARY_IMPL(pagoda_build_test, CPU, m) { m.impl("twice", &twice); }
""")

BUILD_SCRIPT = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from pagoda.kernels.cpu_extension import jit_build
    lib = jit_build("pagoda_build_test", [Path(sys.argv[1])], ["-O0"], Path(sys.argv[2]), label="test build")
    torch.ops.load_library(str(lib))
    print("twice:", torch.ops.pagoda_build_test.twice(torch.ones(2)).tolist())
""")


def _build(src: Path, build_dir: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(src), str(build_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.long
def test_a_build_killed_mid_compile_is_redone_by_the_next_process(tmp_path):
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_CPP)
    build_dir = tmp_path / "cache" / "tiny"
    first = _build(src, build_dir, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (build_dir / "build.ninja").exists():  # the compiler is running
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    time.sleep(1.0)
    os.killpg(first.pid, signal.SIGKILL)  # python, ninja and the compiler, as an OOM kill or `timeout -s KILL` would
    first.wait()
    assert (build_dir / "lock").exists()  # torch's file baton, which used to make every later build wait forever
    assert not (build_dir / cpu_extension.BUILT_MARKER).exists()
    second = _build(src, build_dir)
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out
    assert "twice: [2.0, 2.0]" in out and "compiling the CPU kernels' test build" in out
    third = _build(src, build_dir)  # a complete build is reused, not compiled again
    out, _ = third.communicate(timeout=60)
    assert third.returncode == 0 and "twice: [2.0, 2.0]" in out and "compiling" not in out, out


def test_a_failed_build_is_an_error_with_the_compilers_output(tmp_path):
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++;\n")
    with pytest.raises(cpu_extension.KernelBuildError) as e:
        cpu_extension.jit_build("pagoda_broken_test", [src], ["-O0"], tmp_path / "b", label="broken build")
    msg = str(e.value)
    assert "broken build failed to compile" in msg and "kernels='torch'" in msg
    assert "error" in msg.split("The compiler said:", 1)[1]  # the compiler's own words


def test_a_load_that_failed_raises_again_and_never_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_loaded", cpu_extension._Loaded())
    monkeypatch.setattr(cpu_extension, "prebuilt_library", lambda build: None)

    def fail(*args, **kw):
        raise cpu_extension.KernelBuildError("the C++ CPU kernels' native build failed to compile")

    monkeypatch.setattr(cpu_extension, "jit_build", fail)
    for _ in range(2):
        with pytest.raises(cpu_extension.KernelBuildError, match="failed to compile"):
            cpu_extension.load("native")
    assert cpu_extension.loaded_build() is None
    from pagoda.kernels.policy import KernelPolicy
    with pytest.raises(cpu_extension.KernelBuildError):
        KernelPolicy.resolve("auto")
    assert KernelPolicy.resolve("torch").cpp is False  # asked for by name: the torch-only path


def test_the_prebuilt_library_is_taken_only_when_its_key_matches(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_extension, "PREBUILT_DIR", tmp_path)
    assert cpu_extension.prebuilt_library("avx2") is None
    key = build_spec.build_key("avx2", torch.__version__)
    lib = tmp_path / f"{build_spec.prebuilt_name('avx2', key)}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    lib.write_bytes(b"")
    assert cpu_extension.prebuilt_library("avx2") == lib
    assert cpu_extension.prebuilt_library("native") is None
    other = tmp_path / "cpu"
    other.mkdir()
    for s in build_spec.SRC_DIR.iterdir():
        if s.suffix in (".cpp", ".h"):
            (other / s.name).write_text(s.read_text() + ("\n// edited\n" if s.name == "argmax.cpp" else ""))
    assert cpu_extension.prebuilt_library("avx2", other) is None  # an edited checkout's install is stale


def test_the_build_key_follows_sources_flags_torch_and_cpu(tmp_path):
    src = tmp_path / "cpu"
    src.mkdir()
    (src / "a.cpp").write_text("int a;\n")
    key = build_spec.build_key("native", "2.13.0", src)
    assert key == build_spec.build_key("native", "2.13.0", src)
    assert key != build_spec.build_key("avx2", "2.13.0", src)
    assert key != build_spec.build_key("native", "2.14.0", src)
    (src / "b.h").write_text("// a header counts too\n")
    assert key != build_spec.build_key("native", "2.13.0", src)


@pytest.mark.slow
def test_the_real_build_killed_mid_compile_loads_on_the_next_start(tmp_path):
    """`pagoda` with no prebuilt library (a fresh cache, prebuilt folder hidden), killed mid-compile, then again."""
    env = {**os.environ, "PAGODA_CACHE_DIR": str(tmp_path / "cache")}
    script = ("from pagoda.kernels import cpu_extension as c; c.prebuilt_library = lambda *a, **k: None; c.load(); "
              "print('kernels:', c.loaded_build(), c.build_isa().name)")
    first = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(8)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "kernels: " in out.stdout, out.stdout + out.stderr
    assert time.monotonic() - t0 < 600


@pytest.mark.slow
def test_a_wheel_carries_its_kernels_and_generates_without_compiling(tmp_path):
    """`pip wheel` of the repository, installed into its own folder, generates with the C++ kernels from an empty
    cache: they were compiled when the wheel was built, not at first use."""
    repo = Path(__file__).resolve().parents[1]
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w",
                    str(wheels), str(repo)], check=True, timeout=1200)
    wheel = next(wheels.glob("pagoda-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "PAGODA_CACHE_DIR": str(tmp_path / "cache")}
    script = ("import pagoda; from pagoda import LLM, SamplingParams; llm = LLM(); "
              "out = llm.generate(['Hello'], SamplingParams(max_tokens=4), use_tqdm=False); "
              "print('from', pagoda.__file__); print('build', llm.engine.runner.policy.kernel_build)")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"from {site}" in out.stdout and "(installed)" in out.stdout, out.stdout
    assert "compiling" not in out.stderr
