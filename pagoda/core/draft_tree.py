"""Draft trees: speculative proposals that branch, verified in one target pass.

A tree is the list of its proposals in flat order with each one's parent: an index into that list, or -1 for
the sequence's last token (the root, which the target computes beside them). Parents come before their children,
so a node's ancestors sit before it in the flat order, and a tree cut at any length is still a tree. An empty
parents list is a chain (each proposal's parent is the one before it).

In the target's pass the root and the proposals take consecutive KV slots in flat order; each node gets the RoPE
position of its depth and sees the context and its own ancestors only (`mask_words`, read by paged attention).
Verification walks from the root along the child that matches what the target emits (`greedy_walk`), and the
accepted nodes' KV then moves to the consecutive slots of their depths (`kv_moves`).
"""
from __future__ import annotations

from pagoda.kernels.paged_attention import TREE_SPAN


def depths(parents: list[int]) -> list[int]:
    """Each proposal's depth below the root (a child of the root: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    """The proposals from the root's child down to `node`, in depth order."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def mask_words(parents: list[int], seq_len: int) -> list[int]:
    """Tree-mask words (AttentionMetadata.tree_mask) of the root and each proposal, the tree ending a sequence of
    `seq_len` keys: each sees every key before the tree, the root, and its own ancestors."""
    n = len(parents) + 1
    base = seq_len - TREE_SPAN  # the key bit 0 covers
    context = 0
    for key in range(max(0, base), seq_len - n + 1):  # the keys before the tree, and the root
        context |= 1 << (key - base)
    words = [-1]  # the root: causal
    bits: list[int] = []
    for i, p in enumerate(parents):
        own = (bits[p] if p >= 0 else context) | 1 << (seq_len - n + 1 + i - base)
        bits.append(own)
        words.append(own - (1 << 64) if own >= 1 << 63 else own)  # the int64 the kernel reads
    return words


def greedy_walk(parents: list[int], tokens: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    """Greedy verification: from the root, emit the target's argmax (`argmax[0]` at the root, `argmax[i + 1]` at
    proposal i) and go on to the child proposing it, until none does. Returns the emitted tokens (the accepted
    proposals', then the target's own) and the accepted proposals, in depth order."""
    emitted: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        token = argmax[node + 1]
        emitted.append(token)
        node = next((i for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == token), -1)
        if node < 0:
            return emitted, path
        path.append(node)


def kv_moves(path: list[int], keep: int) -> list[tuple[int, int]]:
    """(from, to) offsets past the root for the KV of the first `keep` accepted proposals: proposal path[j] was
    computed at offset path[j] + 1 and belongs at offset j + 1. Moves are in increasing order and never read an
    offset an earlier move wrote (path[j] >= j)."""
    return [(node + 1, j + 1) for j, node in enumerate(path[:keep]) if node != j]
