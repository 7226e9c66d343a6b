"""StructuredOutputManager: compiles constraints off the step loop and fills one bitmask per step.

Compiling runs in a small thread pool of its own (never the threads that tokenize requests), in killable
worker processes where the config asks for them (compile_workers.py), and is cached by the constraint's text
within a memory budget, so the same schema compiles once; a request waits outside the scheduler until its
grammar is ready while other requests keep running.
Each step fills one bitmask for all constrained rows and applies it to those rows' logits only: the other
rows of the batch are not touched, so they are bit-identical to a batch without constrained rows.

"auto" compiles with xgrammar and, where xgrammar rejects a constraint or is not installed, with llguidance: so
one batch may hold matchers of both. All backends share one bitmask layout (1 bit per token, 32 tokens per int32),
so each fills its own rows and one kernel applies the whole mask.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.config import STRUCTURED_OUTPUTS_BACKENDS, StructuredOutputsConfig, parse_memory
from pagoda.structured.backend import GrammarBackend, Matcher, make_backend
from pagoda.structured.compile_workers import (
    CompileBudget,
    CompileBudgetError,
    CompileCancelled,
    CompileWorkers,
    WorkerSpec,
)
from pagoda.structured.limits import JUMP_FORWARD_MAX_CHARS, check_alternatives, json_schema_sizes
from pagoda.structured.params import StructuredOutputsParams

_PACKAGE = {"xgrammar": "xgrammar", "guidance": "llguidance"}  # the library each backend imports
logger = logging.getLogger(__name__)


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or an import hook that hides it
        return False


def backends_tried(name: str) -> tuple[str, ...]:
    """The backends `name` (STRUCTURED_OUTPUTS_BACKENDS) compiles with, in order. auto is xgrammar then
    llguidance, or llguidance alone where xgrammar is not installed (it is optional: scripts/install.sh adds it
    without triton). A backend named on its own must be importable."""
    if name not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                         f"got {name!r}")
    tried = ("xgrammar", "guidance") if name == "auto" else (name,)
    present = tuple(b for b in tried if _importable(_PACKAGE[b]))
    if name != "auto" and not present:
        raise ValueError(f"structured_outputs_backend={name!r} needs the {_PACKAGE[name]} package, which is not "
                         f"installed (pip install {_PACKAGE[name]}), or use 'auto'")
    if not present:
        raise ValueError("structured outputs need xgrammar or llguidance, and neither is installed")
    if present != tried:
        logger.info("structured outputs: xgrammar is not installed; compiling grammars with llguidance")
    return present


@dataclass
class MaskStats:
    """Running totals of the per-step mask work (filling and applying), for benchmarks."""
    steps: int = 0
    rows: int = 0
    seconds: float = 0.0
    jump_forward_tokens: int = 0  # tokens appended by jump-forward decoding instead of decoded


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled by one backend, and whether its matchers may search for forced text
    (jump-forward): only where limits.py bounds how long that text can be, or the backend bounds it itself."""
    grammar: Any
    backend: GrammarBackend
    jump_forward: bool


@dataclass
class _Cached:
    future: Future
    size: int = 0  # bytes, once compiled


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig | None = None,
                 max_model_len: int | None = None, max_entries: int = 512) -> None:
        """`max_model_len`: a JSON schema whose shortest instance cannot fit in this many tokens is refused."""
        config = config or StructuredOutputsConfig()
        self._tried = backends_tried(config.backend)
        self._tokenizer, self._vocab_size, self._max_model_len = tokenizer, vocab_size, max_model_len
        self._backends: dict[str, GrammarBackend] = {}
        # The backend that made each type of matcher (no two backends share a type).
        self._made_by: dict[type, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()  # building a backend takes a second: cache hits need not wait
        self._pool = ThreadPoolExecutor(max_workers=max(2, config.compile_workers), thread_name_prefix="pagoda-grammar")
        self._workers: CompileWorkers | None = None
        if config.compile_workers:
            spec = WorkerSpec(tokenizer.backend.to_str(), vocab_size, tuple(sorted(tokenizer.stop_token_ids)))
            budget = CompileBudget(config.compile_timeout, parse_memory(config.compile_memory))
            self._workers = CompileWorkers(spec, config.compile_workers, budget)
            self._workers.prestart()
        self._cache: OrderedDict[tuple[str, str], _Cached] = OrderedDict()
        self._cache_bytes, self._cache_limit = 0, int(parse_memory(config.cache_memory) or 0)
        self._max_entries = max_entries
        self.stats = MaskStats()

    @property
    def backend(self) -> GrammarBackend:
        """The backend tried first (auto's is xgrammar where it is installed)."""
        return self._get(self._tried[0])

    def _get(self, name: str) -> GrammarBackend:
        """Built on first use: importing the library and reading the vocabulary takes about a second."""
        with self._build_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = make_backend(name, self._tokenizer.backend, self._vocab_size,
                                       sorted(self._tokenizer.stop_token_ids))
                self._backends[name] = backend
            return backend

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a Future (done at once on a cache hit). Thread-safe.

        The future stays cancellable while it compiles: cancelling it (every client of the compile left) kills
        the worker process compiling it. A constraint that failed stays cached as failed, so sending it again
        costs nothing; a cancelled one is compiled again when asked."""
        key = params.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and not cached.future.cancelled():
                self._cache.move_to_end(key)
                return cached.future
            fut: Future = Future()
            self._cache[key] = _Cached(fut)
            self._pool.submit(self._run, params, key, fut)
            self._evict()
            return fut

    def close(self) -> None:
        """Kill the compile workers (their compiles fail at once); the server calls it as it stops."""
        if self._workers is not None:
            self._workers.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, params: StructuredOutputsParams, key: tuple[str, str], fut: Future) -> None:
        """Compile into `fut` (left PENDING meanwhile, so the waiter can still cancel it), then account its size."""
        try:
            compiled = self._compile(params, fut.cancelled)
        except CompileCancelled as e:  # its waiters left (then this is a no-op), or the manager closed
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(e)
            return
        except BaseException as e:  # noqa: BLE001 - ValueError is the constraint's; anything else the waiter's to see
            with contextlib.suppress(InvalidStateError):
                fut.set_exception(e)
            return
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.future is fut:
                cached.size = compiled.backend.size_bytes(compiled.grammar)
                self._cache_bytes += cached.size
                self._evict(keep=key)
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            fut.set_result(compiled)

    def _evict(self, keep: tuple[str, str] | None = None) -> None:
        """Least recently used first, until the cache is within its bytes and entries (under self._lock). A
        grammar larger than the whole budget is not kept: the requests using it hold it while they run."""
        for key in list(self._cache):
            if self._cache_bytes <= self._cache_limit and len(self._cache) <= self._max_entries:
                break
            if key == keep and self._cache[key].size <= self._cache_limit:
                continue
            cached = self._cache[key]
            if not cached.future.done() and key != keep:
                continue  # compiling: its size is not known yet
            self._cache_bytes -= cached.size
            del self._cache[key]

    def _compile(self, params: StructuredOutputsParams, cancelled: Callable[[], bool]) -> CompiledConstraint:
        """The first backend's grammar that compiles; if none does, the first one's error (and the others').
        A constraint that limits.py refuses reaches no backend; one past its budget is tried by no other."""
        bounded = self._check_limits(params)
        errors: list[tuple[str, ValueError]] = []
        for name in self._tried:
            backend = self._get(name)
            try:
                if self._workers is None:
                    compiled = backend.compile(params)
                else:
                    compiled = backend.deserialize(self._workers.compile(name, params, cancelled))
            except CompileBudgetError:
                raise
            except ValueError as e:
                errors.append((name, e))
                continue
            # llguidance bounds its own search for forced text; xgrammar's runs until it ends.
            return CompiledConstraint(compiled, backend, jump_forward=bounded or name == "guidance")
        first = str(errors[0][1])
        others = "".join(f"; {name}: {str(e).split('does not compile: ', 1)[-1]}" for name, e in errors[1:])
        raise ValueError(first + others)

    def _check_limits(self, params: StructuredOutputsParams) -> bool:
        """Refuse (ValueError) a JSON schema with no instance that fits the context; True where every forced
        path of the constraint is short enough to search for (limits.JUMP_FORWARD_MAX_CHARS)."""
        kind = params.kind
        if kind == "choice":
            check_alternatives(len(params.choice or ()), "a choice list")
            return True  # forced text ends within the longest choice
        if kind == "json_object":
            return True  # forced text ends within an object's key
        if kind in ("regex", "grammar"):
            return False  # a user's grammar may force text without end ("a" root)
        schemas = [params.json] if kind == "json" else _tag_schemas(params.structural_tag)
        bounded = True
        for text in schemas:
            try:
                schema = json.loads(str(text)) if isinstance(text, str) else text
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"structured_outputs: the {kind} is not valid JSON ({type(e).__name__})") from None
            sizes = json_schema_sizes(schema)
            if sizes.shortest > self._max_output_chars():
                what = "has no finite instance (a required property or item refers back to itself)" \
                    if sizes.shortest == float("inf") else \
                    f"needs at least {sizes.shortest:.0f} characters, more than the context of " \
                    f"{self._max_model_len} tokens can hold"
                raise ValueError(f"structured_outputs: the JSON schema {what}")
            bounded = bounded and sizes.largest_part <= JUMP_FORWARD_MAX_CHARS
        return bounded

    def _max_output_chars(self) -> float:
        if self._max_model_len is None:
            return float("inf")
        return float(self._max_model_len * self._tokenizer.max_token_bytes)

    def matcher(self, compiled: CompiledConstraint) -> Matcher:
        matcher = compiled.backend.matcher(compiled.grammar)
        matcher.jump_forward = compiled.jump_forward
        self._made_by.setdefault(type(matcher), compiled.backend)
        return matcher

    def mask_logits(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> list[int]:
        """Forbid, in place, what each matcher's grammar forbids next in its row of `logits`; return the
        rows whose grammar allows no token at all (they cannot go on)."""
        t0 = time.perf_counter()
        try:
            return self._mask(logits, rows, matchers)
        finally:
            self.stats.steps += 1
            self.stats.rows += len(rows)
            self.stats.seconds += time.perf_counter() - t0

    def _mask(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> list[int]:
        groups: dict[GrammarBackend, list[int]] = {}
        for i, m in enumerate(matchers):
            groups.setdefault(self._made_by[type(m)], []).append(i)
        # The first backend's kernel applies every row: under auto that is xgrammar's, also for llguidance rows.
        backend = self._backends.get(self._tried[0]) or next(iter(groups))
        bitmask = backend.allocate_bitmask(len(rows))
        if len(groups) == 1:
            next(iter(groups)).fill_bitmask(matchers, bitmask)
        else:
            for owner, idx in groups.items():
                part = owner.allocate_bitmask(len(idx))
                owner.fill_bitmask([matchers[i] for i in idx], part)
                bitmask[idx] = part
        dead = [rows[i] for i in (bitmask == 0).all(dim=1).nonzero().flatten().tolist()]
        if logits.dtype == torch.float32 and rows == list(range(logits.shape[0])):
            backend.apply_bitmask(logits, bitmask)
            return dead
        # The mask kernel takes fp32; bf16 -> fp32 -> bf16 is exact for the values it leaves.
        index = torch.tensor(rows)
        sub = logits.index_select(0, index).float()
        backend.apply_bitmask(sub, bitmask)
        logits.index_copy_(0, index, sub.to(logits.dtype))
        return dead


def _tag_schemas(tag: Any) -> list[Any]:
    """The JSON schemas inside a structural tag (its structures' `schema`s, in the triggers form)."""
    try:
        tag = json.loads(str(tag)) if isinstance(tag, str) else tag
    except (json.JSONDecodeError, RecursionError):
        return []  # the backend refuses it, naming why
    structures = tag.get("structures") if isinstance(tag, dict) else None
    if not isinstance(structures, list):
        return []
    return [s["schema"] for s in structures if isinstance(s, dict) and isinstance(s.get("schema"), (dict, bool))]
