"""Kernel auto-tuning (kernels/tuning.py): the tuner picks the faster candidate per layer shape, keeps the choice in
its cache file, survives a corrupt one, and a tuned model stays batch invariant and, tuned to the built-in
choice, generates what kernel_tuning="off" generates."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import greedy_tokens

from pagoda.kernels import tuning
from pagoda.kernels.tuning import KernelTuner, TuningShape
from pagoda.paths import TUNING_CACHE_ENV

SHAPE = TuningShape("bfloat16", 32, 64, 0, torch.float32)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The tuner does not cache what it measured on a busy machine, or in passes its thread did not run through (the
    fake kernels below sleep); tests of caching must not depend on the load."""
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    monkeypatch.setattr(tuning, "ran_through", lambda cpu_s, wall_s: True)


def fake(seconds: float, calls: list[str], name: str) -> SimpleNamespace:
    def run(x: torch.Tensor) -> torch.Tensor:
        calls.append(name)
        if seconds:
            time.sleep(seconds)
        return x
    return SimpleNamespace(run=run)


def candidates(slow: str, calls: list[str], built: list[str]) -> dict:
    """Two fake kernels, `slow` one sleeping 2 ms a call; `built` records which builders ran."""
    def builder(name: str):  # noqa: ANN202
        def build() -> SimpleNamespace:
            built.append(name)
            return fake(2e-3 if name == slow else 0.0, calls, name)
        return build
    return {"panels": builder("panels"), "onednn": builder("onednn")}


@pytest.mark.parametrize("slow", ["panels", "onednn"])
def test_tuner_picks_the_faster_candidate(slow, tmp_path):
    tuner, calls, built = KernelTuner(tmp_path / "tuning.json"), [], []
    kernel, entry = tuner.choose(SHAPE, candidates(slow, calls, built))
    fast = "onednn" if slow == "panels" else "panels"
    assert entry.chosen == fast and tuner.measured == 1
    kernel.run(torch.zeros(1))
    assert calls[-1] == fast  # the kernel returned is the chosen one
    assert set(calls) == {"panels", "onednn"} and entry.rows == [1, 8, 64]
    assert all(t >= 2e-3 for t in entry.times[slow]) and entry.scores[slow] > entry.scores[fast]


def test_cache_file_is_written_and_read_by_a_second_tuner_without_measuring(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    first = KernelTuner(path)
    _, entry = first.choose(SHAPE, candidates("panels", [], []))
    assert first.measured == 1 and path.exists()
    # The same shape again in this process: from memory.
    first.choose(SHAPE, candidates("panels", [], []))
    assert first.measured == 1
    saved = json.loads(path.read_text())
    assert saved["entries"][entry.key]["chosen"] == "onednn"

    second, calls, built = KernelTuner(path), [], []
    kernel, cached = second.choose(SHAPE, candidates("panels", calls, built))
    assert second.measured == 0 and calls == [] and built == ["onednn"]  # only the chosen one is even built
    assert cached.chosen == "onednn" and cached.times == entry.times
    # Another thread count is another key: measured anew.
    threads = torch.get_num_threads()
    assert f"threads={threads}" in entry.key


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "entries": {"x": {"rows": 3}}}', "[]",
                                     '{"version": 99, "entries": {}}'])
def test_corrupt_cache_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content):
    path = tmp_path / "tuning.json"
    path.write_text(content)
    tuner = KernelTuner(path)
    with caplog.at_level(logging.WARNING, logger="pagoda.kernels.tuning"):
        _, entry = tuner.choose(SHAPE, candidates("onednn", [], []))
    assert tuner.measured == 1 and entry.chosen == "panels"
    assert any("ignoring" in r.getMessage() for r in caplog.records)
    saved = json.loads(path.read_text())
    assert saved["version"] == 1 and list(saved["entries"]) == [entry.key]
    assert not list(tmp_path.glob(".tuning-*"))  # no temporary file left behind


@pytest.mark.parametrize("second_pass,busy", [("panels", False), ("onednn", True)])
def test_unreliable_times_keep_the_built_in_choice_and_write_nothing(tmp_path, monkeypatch, second_pass, busy):
    """Passes that disagree, or a busy machine: the built-in choice, and the shape is measured again next time."""
    monkeypatch.setattr(tuning, "machine_busy", lambda: busy)
    tuner = KernelTuner(tmp_path / "tuning.json")
    fast = {"panels": [2.0] * 3, "onednn": [1.0] * 3}
    answers = iter([fast, {n: [1.0 if n == second_pass else 2.0] * 3 for n in fast}])
    tuner.measure = lambda kernels, k, dtype: next(answers)  # type: ignore[method-assign]
    _, entry = tuner.choose(SHAPE, candidates("", [], []))
    assert entry.chosen == "panels" and not (tmp_path / "tuning.json").exists()
    monkeypatch.setattr(tuning, "machine_busy", lambda: False)
    again = KernelTuner(tmp_path / "tuning.json")
    again.measure = lambda kernels, k, dtype: fast  # type: ignore[method-assign]
    _, entry = again.choose(SHAPE, candidates("", [], []))
    assert entry.chosen == "onednn" and (tmp_path / "tuning.json").exists()


def test_passes_the_timing_thread_did_not_run_through_are_measured_again(tmp_path, monkeypatch):
    """A pass whose thread waited for its core (its threads woken onto one core after a model load) does not count:
    the shape is measured again, and the choice comes from the passes that ran through."""
    slow_panels = {"panels": [9.0] * 3, "onednn": [1.0] * 3}  # what a half-speed pass made of small layers
    fast = {"panels": [1.0] * 3, "onednn": [2.0] * 3}
    answers, ran = iter([slow_panels, slow_panels, fast, fast]), iter([False, False, True, True])
    monkeypatch.setattr(tuning, "ran_through", lambda cpu_s, wall_s: next(ran))
    tuner = KernelTuner(tmp_path / "tuning.json")
    tuner.measure = lambda kernels, k, dtype: next(answers)  # type: ignore[method-assign]
    _, entry = tuner.choose(SHAPE, candidates("", [], []))
    assert entry.chosen == "panels" and entry.times == fast and (tmp_path / "tuning.json").exists()


def test_a_thread_sharing_its_core_gives_no_choice(tmp_path, monkeypatch):
    """Every thread of this process on one core: no pass runs through, so the built-in choice, not cached."""
    from pagoda.kernels.cpu_extension import kernel_available
    from pagoda.kernels.linear import panel_pack
    from pagoda.kernels.linear_kernel import PANELS, LinearKernel, _without_panels

    monkeypatch.undo()  # the real rule
    if not kernel_available() or len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2:
        pytest.skip("needs the C++ kernels and two compute threads")
    w = torch.randn(576, 576).to(torch.bfloat16)
    if (packed := panel_pack(w)) is None:
        pytest.skip("no panel kernel for bf16 on this CPU")
    kernels = {"panels": lambda: LinearKernel(PANELS, w, None, None, panels=packed),
               "onednn": lambda: _without_panels(w, None)}
    torch.ops.pagoda.packed_linear(torch.zeros(1, 576, dtype=torch.bfloat16), packed, None)  # start the workers
    tasks = [int(t) for t in os.listdir("/proc/self/task")]
    masks = {t: os.sched_getaffinity(t) for t in tasks}
    one = {min(masks[tasks[0]])}
    try:
        for t in tasks:
            os.sched_setaffinity(t, one)
        tuner = KernelTuner(tmp_path / "tuning.json")
        _, entry = tuner.choose(TuningShape("bfloat16", 576, 576, 0, torch.bfloat16), kernels)
    finally:
        for t, mask in masks.items():
            try:
                os.sched_setaffinity(t, mask)
            except OSError:  # a thread that has ended
                pass
    assert entry.chosen == "panels" and not (tmp_path / "tuning.json").exists()


def test_kernel_tuning_is_validated_and_off_gives_the_built_in_choice():
    from pagoda.config import EngineConfig
    from pagoda.kernels.cpu_extension import kernel_available
    from pagoda.kernels.linear import panel_pack
    from pagoda.kernels.linear_formats import DENSE, PANELS
    from pagoda.kernels.linear_kernel import choose_linear_kernel
    from pagoda.kernels.policy import KernelPolicy

    assert os.environ["PAGODA_KERNEL_TUNING"] == "off" == EngineConfig().kernel_tuning  # conftest: the suite's default
    os.environ["PAGODA_KERNEL_TUNING"] = "auto"
    try:
        assert EngineConfig().kernel_tuning == "auto"
    finally:
        os.environ["PAGODA_KERNEL_TUNING"] = "off"
    with pytest.raises(ValueError, match="kernel_tuning"):
        EngineConfig.from_kwargs(None, kernel_tuning="fast")
    assert KernelPolicy.resolve("torch", kernel_tuning="auto").tuner is None  # no C++ kernels: nothing to choose
    off = KernelPolicy.resolve(kernel_tuning="off")
    assert off.tuner is None
    w = torch.randn(64, 128)
    kernel = choose_linear_kernel(w, None, None, torch.float32, off)
    assert kernel.tuning is None
    if kernel_available():
        assert kernel.code == (PANELS if panel_pack(w) is not None else DENSE)


# ---- the real kernels --------------------------------------------------------------------------------------------
def _panels_build() -> bool:
    from pagoda.kernels.cpu_extension import kernel_available
    from pagoda.kernels.linear import panel_pack

    return kernel_available() and panel_pack(torch.randn(64, 128)) is not None


needs_panels = pytest.mark.skipif(not _panels_build(), reason="needs the C++ kernels with the panel kernel")


def force(monkeypatch, which: int | None) -> None:
    """Make every tuner pick its `which`-th candidate (None: measure for real)."""
    if which is None:
        return

    def measure(self, kernels, k, dtype):  # noqa: ANN001, ANN202
        return {name: [1.0 if i == which else 2.0] * len(self.rows) for i, name in enumerate(kernels)}
    monkeypatch.setattr(KernelTuner, "measure", measure)


def tuned_linears(llm) -> list:  # noqa: ANN001
    from pagoda.layers.linear import Linear

    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]


def greedy(llm) -> list[list[int]]:  # noqa: ANN001
    return greedy_tokens(llm, [list(range(3, 3 + n)) for n in (5, 17, 40)], 8)


@needs_panels
@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("which", [0, 1, None], ids=["built-in", "other", "measured"])
def test_tuned_model_is_batch_invariant_and_matches_off_when_tuned_to_the_built_in_choice(
        tiny_llama, default_gguf, tmp_path, monkeypatch, quantization, which):
    from pagoda import LLM

    path = tmp_path / "tuning.json"
    monkeypatch.setenv(TUNING_CACHE_ENV, str(path))
    force(monkeypatch, which)
    kw = dict(tokenizer=default_gguf, dtype="bfloat16", kv_cache_memory="64MiB", quantization=quantization)
    tuned = LLM(tiny_llama, kernel_tuning="auto", **kw)
    linears = tuned_linears(tuned)
    entries = {m.matmul.tuning.key: m.matmul.tuning for m in linears if m.matmul.tuning is not None}
    assert entries  # every layer here has two candidates
    if which is not None:  # a real measurement whose two passes disagree (a busy machine) is not written
        assert set(json.loads(path.read_text())["entries"]) == set(entries)
    assert len(entries) < len(linears)  # layers of one shape share one measurement
    if which is not None:
        assert all(list(e.times)[which] == e.chosen for e in entries.values())

    # Each layer's kernel, whichever was chosen: a row's result does not depend on the rows beside it.
    gen = torch.Generator().manual_seed(0)
    for m in linears:
        x = torch.randn(64, m.in_features, generator=gen).bfloat16()
        full = m(x)
        for rows in (1, 3, 9, 64):
            assert torch.equal(m(x[:rows]), full[:rows]), (m.matmul.tuning.key, rows)
        for i in (0, 5, 63):
            assert torch.equal(m(x[i:i + 1]), full[i:i + 1])

    if which == 0:
        off = LLM(tiny_llama, kernel_tuning="off", **kw)
        assert all(m.matmul.tuning is None for m in tuned_linears(off))
        assert [m.matmul.code for m in tuned_linears(off)] == [m.matmul.code for m in linears]
        assert greedy(tuned) == greedy(off)
    elif which == 1:
        assert tuned.engine.runner.model.stack is None or quantization  # oneDNN layers leave the decoder stack
        assert len(greedy(tuned)[0]) == 8


@needs_panels
def test_bench_throughput_prints_and_reports_the_tuning_table(tiny_llama_byte_tokenizer, tmp_path, monkeypatch,
                                                              capsys):
    from pagoda.entrypoints.cli import main

    monkeypatch.setenv(TUNING_CACHE_ENV, str(tmp_path / "tuning.json"))
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama_byte_tokenizer), "--num-prompts", "2",
               "--input-len-range", "8", "16", "--output-len-range", "2", "4", "--no-roofline", "--dtype", "bfloat16",
               "--kv-cache-memory", "32MiB", "--kernel-tuning", "auto", "--output-json", str(out)])
    assert rc == 0
    tuning = json.loads(out.read_text())["kernel_tuning"]
    assert tuning["mode"] == "auto" and tuning["cache"] == str(tmp_path / "tuning.json")
    shapes = tuning["shapes"]
    assert shapes and sum(s["layers"] for s in shapes) >= 9  # 2 layers x 4 linears + lm_head
    assert all(s["chosen"] in s["times_us"] and len(s["times_us"]["panels"]) == 3 for s in shapes)
    printed = capsys.readouterr().out
    assert "kernel tuning (us at 1/8/64 rows" in printed and "panels" in printed
    assert Path(tuning["cache"]).exists()
