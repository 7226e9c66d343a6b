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


class _FakeMachine:
    """/proc/stat of two cores, a clock and this process's CPU time, advanced by hand."""

    def __init__(self, path: Path) -> None:
        self.path, self.now, self.mine, self.ticks = path, 0.0, 0.0, [0, 0]
        self.hz = os.sysconf("SC_CLK_TCK")
        self._write()

    def _write(self) -> None:
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{c} {t} 0 0 1000 0 0 0 0 0 0" for c, t in enumerate(self.ticks)]
        self.path.write_text("\n".join(lines) + "\n")

    def run(self, seconds: float, mine_cores: float, others_cores: float) -> None:
        """`seconds` pass with this process using `mine_cores` cores' worth of time and others `others_cores`."""
        self.now += seconds
        self.mine += mine_cores * seconds
        busy = round((mine_cores + others_cores) * seconds * self.hz)
        self.ticks = [self.ticks[0] + busy // 2, self.ticks[1] + busy - busy // 2]
        self._write()


def test_threads_give_way_while_another_process_keeps_a_core_busy(tmp_path: Path) -> None:
    m = _FakeMachine(tmp_path / "stat")
    set_to: list[int] = []
    gov = cpus.ThreadGovernor([0, 1], 2, set_to.append, interval=0.5, stat_path=m.path, clock=lambda: m.now,
                              own_cpu=lambda: m.mine)
    gov.tick()
    for _ in range(4):  # quiet: this process's own work never counts as someone else's
        m.run(1.0, 2.0, 0.0)
        gov.tick()
    assert gov.threads == 2 and set_to == []
    m.run(0.1, 2.0, 0.0)
    gov.tick()  # before the interval: not read
    m.run(0.4, 2.0, 0.0)
    gov.tick()
    m.run(1.0, 1.5, 0.5)  # a busy process shares a core with one of the threads
    gov.tick()
    assert gov.threads == 2 and gov.others == pytest.approx(0.5, abs=0.05)  # one reading is not enough
    m.run(1.0, 1.5, 0.5)
    gov.tick()
    assert gov.threads == 1 and set_to == [1]
    for _ in range(3):  # on one thread, the other process has its core to itself: stays at one
        m.run(1.0, 1.0, 1.0)
        gov.tick()
    assert gov.threads == 1 and set_to == [1]
    m.run(1.0, 1.0, 0.0)  # it stopped: the threads come back at the first reading
    gov.tick()
    assert gov.threads == 2 and set_to == [1, 2]
    m.run(1.0, 2.0, 0.1)  # light noise does not take a core away
    gov.tick()
    m.run(1.0, 2.0, 0.1)
    gov.tick()
    assert gov.threads == 2 and set_to == [1, 2]
    m.run(30.0, 0.0, 1.0)  # an idle engine, while another process ran: no step, no reading
    gov.tick()
    m.run(0.5, 2.0, 0.0)  # the first reading after the gap covers only the steps since
    gov.tick()
    m.run(0.5, 2.0, 0.0)
    gov.tick()
    assert gov.threads == 2 and set_to == [1, 2] and gov.others == pytest.approx(0.0, abs=0.05)


def test_no_governor_where_the_threads_are_not_one_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus, "affinity", lambda: [0, 1, 2, 3])
    assert cpus.ThreadGovernor.for_this_process(2, lambda n: None) is None  # a quota or the user chose fewer
    assert cpus.ThreadGovernor.for_this_process(4, lambda n: None) is not None
    monkeypatch.setattr(cpus, "affinity", lambda: [0])
    assert cpus.ThreadGovernor.for_this_process(1, lambda n: None) is None


def test_outputs_do_not_depend_on_the_thread_count(tiny_llama: str, default_gguf: str) -> None:
    """What lets the governor change the thread count mid-run: every kernel splits rows and columns across threads,
    never a sum, so tokens and logprobs are the same bits on one thread or several."""
    from pagoda import LLM, SamplingParams

    before = torch.get_num_threads()
    prompts = [{"prompt_token_ids": list(range(5 + 7 * i, 30 + 19 * i))} for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    try:
        for kw in ({"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"},
                   {"dtype": "bfloat16", "quantization": "int4", "kv_cache_dtype": "int8"}):
            llm = LLM(tiny_llama, tokenizer=default_gguf, kv_cache_memory="32MiB", **kw)
            runs = []
            for n in (max(2, before), 1):
                torch.set_num_threads(n)
                outs = llm.generate(prompts, params, use_tqdm=False)
                runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            assert runs[0] == runs[1], kw
    finally:
        torch.set_num_threads(before)
