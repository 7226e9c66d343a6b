"""Grammar compiles in killable worker processes: the same grammar as in-process, a time and a memory budget that
kill the worker, cancellation and shutdown that kill it too, and a grammar cache bounded in bytes."""
from __future__ import annotations

import time
from concurrent.futures import CancelledError

import psutil
import pytest

from pagoda.config import StructuredOutputsConfig
from pagoda.model.tokenizer import load_tokenizer
from pagoda.structured.compile_workers import CompileBudgetError, CompileCancelled
from pagoda.structured.manager import StructuredOutputManager
from pagoda.structured.params import StructuredOutputsParams

VOCAB = 49152
SCHEMA = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
# About 30 MB and a few seconds of xgrammar's compile: long and large enough to be caught by either budget.
SLOW = StructuredOutputsParams(regex="(" + "|".join(f"w{i}x" for i in range(20000)) + ")")


@pytest.fixture(scope="module")
def tokenizer(default_gguf: str):
    return load_tokenizer(default_gguf)


def manager(tokenizer, **kw) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, VOCAB, StructuredOutputsConfig(backend="xgrammar", **kw))


def _gone(pid: int, within: float) -> bool:
    """Whether process `pid` ends within `within` seconds (the compile thread reaps it, not this one)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _accepts(m: StructuredOutputManager, compiled, tokenizer, text: str) -> bool:
    matcher = m.matcher(compiled)
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.is_completed()


def test_a_grammar_compiled_in_a_worker_matches_as_one_compiled_here(tokenizer) -> None:
    here, there = manager(tokenizer), manager(tokenizer, compile_workers=1, compile_timeout=60)
    try:
        local, remote = here.compile(SCHEMA).result(60), there.compile(SCHEMA).result(60)
        for text, ok in (('{"a": 12}', True), ('{"b": 12}', False), ('{"a": "x"}', False)):
            assert _accepts(here, local, tokenizer, text) == _accepts(there, remote, tokenizer, text) == ok, text
    finally:
        there.close()


def test_a_compile_past_its_time_is_killed_and_the_next_one_gets_a_new_worker(tokenizer) -> None:
    m = manager(tokenizer, compile_workers=1, compile_timeout=0.5)
    try:
        m.compile(SCHEMA).result(60)  # the worker is up
        (pid,) = [w.proc.pid for w in m._workers._all]  # type: ignore[union-attr]
        t0 = time.monotonic()
        with pytest.raises(CompileBudgetError, match="within 0.5 s.*--structured-outputs-compile-timeout"):
            m.compile(SLOW).result(60)
        assert time.monotonic() - t0 < 3 and _gone(pid, 1)
        with pytest.raises(CompileBudgetError):  # a failure stays cached: sending it again costs nothing
            m.compile(SLOW).result(0.1)
        assert m.compile(StructuredOutputsParams(regex="[0-9]+")).result(60) is not None
    finally:
        m.close()


def test_a_compile_past_its_memory_is_killed(tokenizer) -> None:
    m = manager(tokenizer, compile_workers=1, compile_memory="4MiB", compile_timeout=60)
    try:
        with pytest.raises(CompileBudgetError, match="more than 4 MiB.*--structured-outputs-compile-memory"):
            m.compile(SLOW).result(60)
    finally:
        m.close()


def test_cancelling_a_compile_kills_its_worker_and_closing_fails_the_rest(tokenizer) -> None:
    m = manager(tokenizer, compile_workers=1, compile_timeout=60)
    try:
        m.compile(SCHEMA).result(60)
        (worker,) = m._workers._all  # type: ignore[union-attr]
        fut = m.compile(SLOW)
        time.sleep(1.0)  # sent to the worker (a compile cancelled before that never reaches a worker)
        deadline = time.monotonic() + 30
        while psutil.Process(worker.proc.pid).cpu_percent(0.1) < 50:  # the worker is compiling it
            assert time.monotonic() < deadline, "the worker never started the compile"
        assert fut.cancel()  # still cancellable while it compiles
        assert _gone(worker.proc.pid, 10)
        pending = m.compile(SLOW)  # compiled again (a cancelled entry is not kept)
        time.sleep(0.3)
        m.close()
        with pytest.raises(CompileCancelled):
            pending.result(5)
    finally:
        m.close()
    with pytest.raises(CancelledError):
        fut.result(0)


def test_the_cache_is_bounded_in_bytes(tokenizer) -> None:
    m = manager(tokenizer, cache_memory="3MiB")
    first = StructuredOutputsParams(regex="[a-z]{1,200}(,[a-z]{1,200}){0,300}")  # about 2 MB compiled
    second = StructuredOutputsParams(regex="[A-Z]{1,200}(;[A-Z]{1,200}){0,300}")
    a = m.compile(first)
    a.result(60)
    assert m.compile(first) is a  # kept
    m.compile(second).result(60)
    assert m._cache_bytes <= 3 << 20
    assert m.compile(first) is not a  # evicted for the second: compiled again
