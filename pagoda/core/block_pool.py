"""BlockPool: reference-counted fixed-size KV blocks, handed out from a free list."""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache pool has no blocks: raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked {n}, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, blocks: list[int]) -> None:
        # Reverse order: a sequence's tail blocks return to the free list first.
        for b in reversed(blocks):
            rc = self.ref_counts[b] - 1
            assert rc >= 0, f"negative reference count on block {b}"
            self.ref_counts[b] = rc
            if rc == 0:
                self._free.append(b)
