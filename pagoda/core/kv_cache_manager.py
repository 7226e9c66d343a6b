"""KVCacheManager: each sequence's block table over the shared BlockPool, with copy-on-write forks."""
from __future__ import annotations

from pagoda.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        # (src, dst) block copies the model runner must do before this step's forward.
        self.pending_copies: list[tuple[int, int]] = []

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, seq_id: int, num_computed: int, num_new: int) -> bool:
        """Make room to write tokens [num_computed, num_computed + num_new). False if the pool is short.

        The first block written may be shared with a forked sibling: it is copied first (copy-on-write),
        so a sibling's KV is never overwritten.
        """
        table = self.block_tables.setdefault(seq_id, [])
        need_new = self.blocks_needed(num_computed + num_new) - len(table)
        first = num_computed // self.block_size
        cow = first < len(table) and self.pool.ref_counts[table[first]] > 1
        if need_new + cow > self.pool.num_free:
            return False
        if cow:
            (dst,) = self.pool.allocate(1)
            self.pending_copies.append((table[first], dst))
            self.pool.decref([table[first]])
            table[first] = dst
        if need_new > 0:
            table.extend(self.pool.allocate(need_new))
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all of the parent's blocks (parallel sampling, n > 1)."""
        table = self.block_tables[parent_id]
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)

    def free(self, seq_id: int) -> None:
        table = self.block_tables.pop(seq_id, None)
        if table:
            self.pool.decref(table)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
