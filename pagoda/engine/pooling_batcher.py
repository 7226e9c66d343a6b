"""A dynamic batcher for pooling requests, as Triton's: a request waits up to `max_queue_delay_ms` for others,
then every waiting sequence that fits the token and sequence budgets runs in one packed forward on the
batcher's own thread (never on the server's event loop). Packing is varlen (executor/pooling_runner.py), so a
batch costs the sum of its sequences' tokens, not the longest times the count, and each sequence's result
does not depend on its batch mates."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagoda.config import PoolingConfig
from pagoda.engine.step_turns import build_then_serve
from pagoda.executor.pooling_runner import PoolingInput, PoolingRunner

logger = logging.getLogger(__name__)


class BatchObserver(Protocol):
    """What the batcher reports (the server's metrics)."""

    def on_pooling_batch(self, num_seqs: int, num_tokens: int, queue_delays: list[float]) -> None: ...


@dataclass(slots=True)
class _Pending:
    item: PoolingInput
    future: Future[torch.Tensor]
    arrival: float = field(default_factory=time.monotonic)


class PoolingBatcher:
    """Owns one thread that runs `runner`; `submit` and `pool` may be called from any thread or event loop."""

    def __init__(self, runner: PoolingRunner, config: PoolingConfig, observer: BatchObserver | None = None) -> None:
        """Not started: `launch` builds the runner on the batcher's thread and starts it."""
        self.runner = runner
        self.config = config
        self.observer = observer
        self._queue: deque[_Pending] = deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    @classmethod
    def launch(cls, build: Callable[[], PoolingRunner], config: PoolingConfig,
               observer: BatchObserver | None = None) -> PoolingBatcher:
        """Build the runner on the thread that runs it (the model's OpenMP regions all open there: see
        AsyncEngine.launch), and start; raises what `build` raised."""
        def build_batcher() -> PoolingBatcher:
            batcher = cls(build(), config, observer)
            batcher._thread = threading.current_thread()
            return batcher

        return build_then_serve("pagoda-pooling", build_batcher, lambda batcher: batcher._loop())

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def submit(self, items: list[PoolingInput]) -> list[Future[torch.Tensor]]:
        """Queue `items`; each future resolves to its vector (or score)."""
        pending = [_Pending(item, Future()) for item in items]
        with self._cv:
            if self._stopped:
                raise RuntimeError("the pooling batcher has stopped")
            self._queue.extend(pending)
            self._cv.notify()
        return [p.future for p in pending]

    async def pool(self, items: list[PoolingInput]) -> list[torch.Tensor]:
        """`submit`, awaited. A cancelled caller's items are dropped if they have not started."""
        futures = self.submit(items)
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def stop(self) -> None:
        """Fail what waits, and end the thread after its current batch."""
        with self._cv:
            self._stopped = True
            while self._queue:
                self._queue.popleft().future.set_exception(RuntimeError("the pooling batcher has stopped"))
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the thread ------------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Pending]:
        """Block until the oldest request's delay has passed or the budgets are full, then take a batch."""
        cfg = self.config
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return []
            deadline = self._queue[0].arrival + cfg.max_queue_delay_ms / 1000
            while not self._stopped and not self._full():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            batch: list[_Pending] = []
            tokens = 0
            while self._queue and len(batch) < cfg.max_num_seqs:
                head = self._queue[0]
                n = len(head.item.token_ids)
                if batch and tokens + n > cfg.max_num_batched_tokens:
                    break
                self._queue.popleft()
                if head.future.set_running_or_notify_cancel():  # False: its caller gave up while it waited
                    batch.append(head)
                    tokens += n
            return batch

    def _full(self) -> bool:
        tokens = sum(len(p.item.token_ids) for p in self._queue)
        return len(self._queue) >= self.config.max_num_seqs or tokens >= self.config.max_num_batched_tokens

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                if self._stopped:
                    return
                continue
            start = time.monotonic()
            try:
                results = self.runner.run([p.item for p in batch])
            except Exception as e:  # noqa: BLE001 - the callers get the error, the thread goes on
                logger.exception("pooling forward failed")
                for p in batch:
                    p.future.set_exception(e)
                continue
            for p, r in zip(batch, results):
                p.future.set_result(r)
            if self.observer is not None:
                self.observer.on_pooling_batch(len(batch), sum(len(p.item.token_ids) for p in batch),
                                               [start - p.arrival for p in batch])
