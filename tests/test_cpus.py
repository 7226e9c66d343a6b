"""The cores and threads an engine runs with: the affinity mask capped by a cgroup CPU quota, or what the user
names (pagoda/cpus.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagoda import cpus


@pytest.mark.parametrize("text, cores", [("0", [0]), ("0-3,6", [0, 1, 2, 3, 6]), ("2,0-1,1", [0, 1, 2])])
def test_cpu_lists_read_as_taskset_writes_them(text: str, cores: list[int]) -> None:
    assert cpus.parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-2"])
def test_a_bad_cpu_list_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="cpus"):
        cpus.parse_cpu_list(text)


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cgroup_quota_is_read_from_v2_or_v1(tmp_path: Path, files: dict[str, str], limit: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpus.cgroup_cpu_limit(tmp_path) == limit


def test_threads_follow_the_usable_cores_not_the_machine() -> None:
    assert cpus.default_threads(list(range(64)), 2.0) == 2  # docker --cpus 2 on a 64-core host
    assert cpus.default_threads(list(range(64)), 1.5) == 2
    assert cpus.default_threads([0, 1], None) == 2
    assert cpus.default_threads([3], 8.0) == 1


def test_resolve_refuses_cores_outside_the_mask_and_respects_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "affinity", lambda: [0, 1])
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    with pytest.raises(ValueError, match="core\\(s\\) 5 are not available"):
        cpus.resolve("0,5", None)
    assert cpus.resolve("1", None) == ([1], 1)
    assert cpus.resolve(None, 3) == (None, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpus.resolve(None, None) == (None, None)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpus.resolve(None, None) == (None, 2)


def test_an_engine_runs_the_threads_it_is_given(default_gguf: str) -> None:
    from pagoda import LLM, SamplingParams

    before, mask = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        llm = LLM(dtype="float32", kv_cache_memory="32MiB", max_model_len=128, threads=1, cpus=str(min(mask)))
        assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {min(mask)}
        out = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, mask)
