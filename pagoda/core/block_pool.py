"""BlockPool: reference-counted fixed-size KV blocks, with a prefix cache over full blocks.

Free blocks sit in an LRU queue. A free block may still hold a cached prefix (its hash stays in
`cached`): it can be revived by a later request until allocation evicts it, oldest first. Sequences
free their blocks tail first, so a request's tail is evicted before its head.
"""
from __future__ import annotations

from collections import OrderedDict

BlockHash = bytes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache pool has no blocks: raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        # Insertion order is eviction order (least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked {n}, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] == 0:  # a cached free block comes back to life
                del self._free[b]
            self.ref_counts[b] += 1

    def decref(self, blocks: list[int]) -> None:
        # Reverse order: a sequence's tail blocks join the free queue first, so they are evicted first.
        for b in reversed(blocks):
            rc = self.ref_counts[b] - 1
            assert rc >= 0, f"negative reference count on block {b}"
            self.ref_counts[b] = rc
            if rc == 0:
                self._free[b] = None

    # ---- prefix cache --------------------------------------------------------------------------
    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def register(self, block: int, h: BlockHash) -> None:
        """Mark a full block as holding the prefix `h` (first writer wins on duplicates)."""
        if self.block_hash[block] is None and h not in self.cached:
            self.block_hash[block] = h
            self.cached[h] = block

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            del self.cached[h]

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
