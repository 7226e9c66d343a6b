"""KVCacheManager: each sequence's block table over the shared BlockPool.

It gives copy-on-write forks for parallel sampling, and prefix caching: every full block gets a
hash chained from its parent's (SHA-256 over the parent hash and the block's token ids; the root
covers the model, the KV dtype, the request's cache_salt and its LoRA adapter). A new sequence reuses the longest
run of cached full blocks and computes only the rest. SHA-256 makes a collision, and so wrong KV,
practically impossible; no token-id recheck is needed.

With a sliding window on every layer (Mistral), a query at p reads keys (p - window, p] only: blocks that
fall out of the window of every query still to come are freed as the sequence advances
(release_out_of_window, as vLLM's sliding-window manager does), so a long context holds window-sized KV.
Their table entries become FREED, which attention never reads (it starts at the block of a query's first
visible key).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from pagoda.core.block_pool import BlockHash, BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FREED = -1  # a block-table entry whose block left the sliding window and was freed


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0     # of which found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_namespace: str = "", sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's, or None (some layer reads the whole context)
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._root = hashlib.sha256(cache_namespace.encode()).digest()
        self.block_tables: dict[int, list[int]] = {}
        # Hash chain of each sequence's full blocks registered so far.
        self._hashes: dict[int, list[BlockHash]] = {}
        # (src, dst) block copies the model runner must do before this step's forward.
        self.pending_copies: list[tuple[int, int]] = []
        self.stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, computing at most `max_step_tokens` a
        step: all of them, or with a sliding window the window's and one step's (plus a partial block)."""
        need = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return need
        return min(need, self.blocks_needed(self.sliding_window + max_step_tokens) + 1)

    def _block_hash(self, parent: BlockHash, tokens: list[int]) -> BlockHash:
        return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()

    def _root_for(self, salt: str | None, adapter: str | None = None) -> BlockHash:
        root = self._root if not salt else hashlib.sha256(self._root + b"salt:" + salt.encode()).digest()
        return root if adapter is None else hashlib.sha256(root + b"lora:" + adapter.encode()).digest()

    # ---- prefix cache --------------------------------------------------------------------------
    def acquire_cached_prefix(self, seq_id: int, token_ids: list[int], salt: str | None,
                              adapter: str | None = None) -> int:
        """Take references on the longest cached prefix of full blocks for a sequence with no KV yet.

        Returns the number of tokens whose KV is reused. At least the last token is left to compute,
        so the step still produces its logits.
        """
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes: list[BlockHash] = []
        blocks: list[int] = []
        parent = self._root_for(salt, adapter)
        for i in range((len(token_ids) - 1) // bs):
            h = self._block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            b = self.pool.lookup(h)
            if b is None:
                break
            hashes.append(h)
            blocks.append(b)
            parent = h
        num_cached = len(blocks) * bs
        if self.sliding_window is not None:  # only the blocks the next query's window reaches are taken
            end = max(0, num_cached - self.sliding_window + 1) // bs
            blocks[:end] = [FREED] * end
        self.pool.incref([b for b in blocks if b != FREED])
        self.block_tables[seq_id] = blocks
        self._hashes[seq_id] = hashes
        return num_cached

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int, salt: str | None,
                          adapter: str | None = None) -> None:
        """Register the sequence's newly completed full blocks (their KV is now written)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(seq_id, [])
        table = self.block_tables[seq_id]
        bs = self.block_size
        parent = hashes[-1] if hashes else self._root_for(salt, adapter)
        for i in range(len(hashes), num_computed // bs):
            parent = self._block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
            self.pool.register(table[i], parent)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------------
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

    def release_out_of_window(self, seq_id: int, num_computed: int) -> None:
        """Free the blocks before the one holding the first key the next query (at `num_computed`) sees.
        Every later query sees no earlier key, so nothing reads them again; cached ones stay in the prefix
        cache until evicted."""
        if self.sliding_window is None:
            return
        table = self.block_tables.get(seq_id)
        if not table:
            return
        end = max(0, num_computed - self.sliding_window + 1) // self.block_size
        out = [b for b in table[:end] if b != FREED]
        if out:
            self.pool.decref(out)
            table[:end] = [FREED] * end

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (KV of rejected speculative tokens).

        Slots past num_tokens inside the kept last block are simply overwritten later: attention never
        reads past a sequence's length, and only blocks full of accepted tokens are ever hashed."""
        table = self.block_tables.get(seq_id)
        keep = self.blocks_needed(num_tokens)
        if table and len(table) > keep:
            self.pool.decref(table[keep:])
            del table[keep:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all of the parent's blocks (parallel sampling, n > 1)."""
        table = self.block_tables[parent_id]
        self.pool.incref([b for b in table if b != FREED])
        self.block_tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; its full blocks stay cached until evicted."""
        self._hashes.pop(seq_id, None)
        table = self.block_tables.pop(seq_id, None)
        if table:
            self.pool.decref([b for b in table if b != FREED])

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
