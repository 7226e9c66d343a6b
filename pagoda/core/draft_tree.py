"""Draft trees: speculative proposals that branch, verified in one target pass.

A tree is the list of its proposals in flat order with each one's parent: an index into that list, or -1 for
the sequence's last token (the root, which the target computes beside them). Parents come before their children,
so a node's ancestors sit before it in the flat order, and a tree cut at any length is still a tree. An empty
parents list is a chain (each proposal's parent is the one before it).

In the target's pass the root and the proposals take consecutive KV slots in flat order; each node gets the RoPE
position of its depth and sees the context and its own ancestors only (`verify_layout`, read by paged attention).
Verification walks from the root along the child that matches what the target emits (`greedy_walk`), and the
accepted nodes' KV then moves to the consecutive slots of their depths (`kv_moves`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from pagoda.kernels.paged_attention import TREE_SPAN


@dataclass(frozen=True)
class TokenTree:
    """A static draft tree in vLLM's `speculative_token_tree` form: each node the path of child ranks from the root
    ((0,) the drafter's most likely first token, (1,) its second, (0, 0) the most likely below (0,)), in flat
    order: by depth, then by path, so parents and lower ranks come first."""
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, spec: str | list) -> TokenTree:
        """From vLLM's string ("[(0,), (1,), (0, 0)]", a Python literal, read without evaluating code) or a
        list of lists (JSON); raises ValueError naming the key."""
        key = "speculative_config.speculative_token_tree"
        try:
            raw = ast.literal_eval(spec) if isinstance(spec, str) else spec
            paths = sorted({tuple(p) for p in raw}, key=lambda p: (len(p), p))
        except (ValueError, TypeError, SyntaxError) as e:
            raise ValueError(f"{key}: not a list of paths ({e})") from None
        if not paths or len(paths) != len(raw):
            raise ValueError(f"{key}: a non-empty list of distinct paths")
        if len(paths) >= TREE_SPAN:  # with the root, the nodes fit the span the tree mask covers
            raise ValueError(f"{key}: at most {TREE_SPAN - 1} nodes, got {len(paths)}")
        known = set(paths)
        for p in paths:
            if not p or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
                raise ValueError(f"{key}: {p!r} is not a path of ranks (non-negative integers)")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"{key}: {p!r} has no parent {p[:-1]!r}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in known:
                raise ValueError(f"{key}: {p!r} has no sibling of rank {p[-1] - 1} before it")
        return cls(tuple(paths))

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    def inner(self) -> tuple[tuple[int, ...], ...]:
        """The nodes with children: those a drafter runs to draft the next depth."""
        known = set(self.paths)
        return tuple(p for p in self.paths if p + (0,) in known)

    def cut(self, depth: int) -> TokenTree:
        """The nodes at most `depth` deep (the adaptive controller's choice)."""
        return TokenTree(tuple(p for p in self.paths if len(p) <= depth))

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @property
    def parents(self) -> list[int]:
        """Each node's parent's index (-1: the root), core/draft_tree's form."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    def level_sizes(self) -> list[int]:
        """Nodes per depth: what each depth costs the verification."""
        sizes = [0] * self.depth
        for p in self.paths:
            sizes[len(p) - 1] += 1
        return sizes


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


def mask_word(visible: list[int], context: int, seq_len: int) -> int:
    """One query's tree-mask word (AttentionMetadata.tree_mask): it sees keys [0, context) and the keys
    `visible`, of a sequence of `seq_len` keys."""
    base = seq_len - TREE_SPAN  # the key bit 0 covers
    bits = (1 << (context - base)) - (1 << max(0, -base))  # keys [max(0, base), context)
    for key in visible:
        bits |= 1 << (key - base)
    return bits - (1 << 64) if bits >= 1 << 63 else bits  # the int64 the kernel reads


def verify_layout(parents: list[int], start: int, end: int) -> tuple[list[int], list[int]]:
    """The RoPE positions and tree-mask words of a row computing [start, end) whose last len(parents) tokens are
    a draft tree below the token before them (the root): the tokens up to the root are causal at their own
    positions; each proposal sits at the root's position plus its depth and sees the context, the root and its
    own ancestors."""
    root = end - len(parents) - 1
    positions = [*range(start, root + 1), *(root + d for d in depths(parents))]
    words = [-1] * (root + 1 - start)
    words += [mask_word([root + 1 + a for a in path_to(parents, i)], root + 1, end) for i in range(len(parents))]
    return positions, words


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
