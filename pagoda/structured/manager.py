"""StructuredOutputManager: compiles constraints off the step loop and fills one bitmask per step.

Compiling runs in a small thread pool and is cached by the constraint's text, so the same schema compiles
once; a request waits outside the scheduler until its grammar is ready while other requests keep running.
Each step fills one bitmask for all constrained rows and applies it to those rows' logits only: the other
rows of the batch are not touched, so they are bit-identical to a batch without constrained rows.

"auto" compiles with xgrammar and, where xgrammar rejects a constraint or is not installed, with llguidance: so
one batch may hold matchers of both. All backends share one bitmask layout (1 bit per token, 32 tokens per int32),
so each fills its own rows and one kernel applies the whole mask.
"""
from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.structured.backend import GrammarBackend, Matcher
from pagoda.structured.params import StructuredOutputsParams

BACKENDS = ("auto", "xgrammar", "guidance")
_PACKAGE = {"xgrammar": "xgrammar", "guidance": "llguidance"}  # the library each backend imports
logger = logging.getLogger(__name__)


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or an import hook that hides it
        return False


def backends_tried(name: str) -> tuple[str, ...]:
    """The backends `name` (BACKENDS) compiles with, in order. auto is xgrammar then llguidance, or llguidance
    alone where xgrammar is not installed (it is optional: scripts/install.sh adds it without triton). A backend
    named on its own must be importable."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
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


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, backend: str = "auto", cache_size: int = 512) -> None:
        self._tried = backends_tried(backend)
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._backends: dict[str, GrammarBackend] = {}
        # The backend that made each type of compiled grammar and matcher (no two backends share a type).
        self._made_by: dict[type, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()  # building a backend takes a second: cache hits need not wait
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagoda-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_size = cache_size
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
                stop = sorted(self._tokenizer.stop_token_ids)
                if name == "xgrammar":
                    from pagoda.structured.xgrammar_backend import XGrammarBackend

                    backend = XGrammarBackend(self._tokenizer.backend, self._vocab_size, stop)
                else:
                    from pagoda.structured.guidance_backend import GuidanceBackend

                    backend = GuidanceBackend(self._tokenizer.backend, self._vocab_size, stop)
                self._backends[name] = backend
            return backend

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a Future (done at once on a cache hit). Thread-safe."""
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """The first backend's grammar that compiles; if none does, the first one's error (and the others')."""
        errors: list[tuple[str, ValueError]] = []
        for name in self._tried:
            backend = self._get(name)
            try:
                compiled = backend.compile(params)
            except ValueError as e:
                errors.append((name, e))
                continue
            self._made_by[type(compiled)] = backend
            return compiled
        first = str(errors[0][1])
        others = "".join(f"; {name}: {str(e).split('does not compile: ', 1)[-1]}" for name, e in errors[1:])
        raise ValueError(first + others)

    def matcher(self, compiled: Any) -> Matcher:
        backend = self._made_by[type(compiled)]
        matcher = backend.matcher(compiled)
        self._made_by.setdefault(type(matcher), backend)
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
