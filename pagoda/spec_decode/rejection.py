"""Rejection sampling of proposals against the target (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Alg. 2).

For draft token x_i drawn from q_i, accept with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a token from norm(max(0, p_i - q_i)) and stop; if all k are accepted, emit a bonus token
from p_{k}. Every emitted token is then distributed exactly as under p alone. Greedy rows (temperature 0)
accept the longest prefix equal to the target's argmax, plus the target's next argmax: bit-identical to
decoding without speculation; a greedy row's draft tree the same along the branch that matches
(core/draft_tree.py). A point-mass q (n-gram proposals) makes the rule: accept with p_i(x_i), on rejection
resample from p_i with x_i removed; a sampled row's tree applies it to each node's children in turn
(`_sample_tree`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.core import draft_tree
from pagoda.layers.sampler import SamplingBatch, target_distribution


@dataclass
class SpecRow:
    """One request's verification: its proposals and the sampling state at the first position."""
    draft: list[int]                        # k proposals
    draft_probs: torch.Tensor | None        # [k, V] q_i for drafted rows; None = point mass (n-gram)
    params_batch_index: int                 # the row's first position in the expanded SamplingBatch
    parents: list[int] = field(default_factory=list)  # a draft tree's (core/draft_tree.py); empty: a chain


def accepts(u: float, p_x: float, q_x: float) -> bool:
    """The acceptance test u < p(x)/q(x), u ~ U[0, 1) (tests replace it to show a wrong rule is caught)."""
    return u * q_x < p_x


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _sample_tree(row: SpecRow, probs: torch.Tensor, gen: torch.Generator | None) -> tuple[list[int], list[int]]:
    """A sampled row's draft tree, its proposals point masses (the head's top tokens, not draws from q): at each
    node its children are tried in turn, each accepted with the probability the residual gives it, the residual
    losing each rejected one (renormalized); a node whose children all fail, or a leaf, emits a draw from what is
    left. Each emitted token is then distributed exactly as under p: the first child is taken with p(x1), the
    second with (1 - p(x1)) * p(x2) / (1 - p(x1)) = p(x2), any other token with p(y). `probs`: the target at
    the root, then after each proposal. Returns the emitted tokens and the accepted proposals."""
    emitted: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        p = probs[node + 1].clone()
        chosen = -1
        for child in (i for i, parent in enumerate(row.parents) if parent == node):
            x = row.draft[child]
            if accepts(float(torch.rand((), generator=gen)), float(p[x]), 1.0):
                chosen = child
                break
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0:  # p was all on rejected proposals: rejection had probability 0
                break
            p /= total
        if chosen < 0:
            emitted.append(_draw(p if float(p.sum()) > 0 else probs[node + 1], gen))
            return emitted, path
        emitted.append(row.draft[chosen])
        path.append(chosen)
        node = chosen


def verify(logits: torch.Tensor, batch: SamplingBatch, rows: list[SpecRow]) -> tuple[list[list[int]], list[list[int]]]:
    """logits: fp32 [sum(1 + k_r), V], the target at each row's last token and its proposals, in row order;
    `batch` has one entry per such position, with the history up to that position (drafts included).
    Returns the emitted tokens per row (the accepted proposals plus one token from the target), and the
    accepted proposals' indices (a chain's 0, 1, ...; a tree's branch, in depth order)."""
    greedy_ids, probs = target_distribution(logits, batch)
    greedy = greedy_ids.tolist()
    out: list[list[int]] = []
    tree_paths: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        base, k = row.params_batch_index, len(row.draft)
        params = batch.params[base]
        emitted: list[int] = []
        if row.parents:  # a tree
            if params.greedy or probs is None:
                emitted, tree_paths[r] = draft_tree.greedy_walk(row.parents, row.draft, greedy[base:base + k + 1])
            else:
                emitted, tree_paths[r] = _sample_tree(row, probs[base:base + k + 1], batch.generators[base])
            out.append(emitted)
            continue
        if params.greedy or probs is None:
            for i, x in enumerate(row.draft):
                emitted.append(greedy[base + i])
                if x != greedy[base + i]:
                    break
            else:
                emitted.append(greedy[base + k])
            out.append(emitted)
            continue
        gen = batch.generators[base]
        for i, x in enumerate(row.draft):
            p = probs[base + i]
            q_x = 1.0 if row.draft_probs is None else float(row.draft_probs[i, x])
            u = float(torch.rand((), generator=gen))
            if accepts(u, float(p[x]), q_x):
                emitted.append(x)
                continue
            if row.draft_probs is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - row.draft_probs[i]).clamp_(min=0.0)
            # A zero residual means p <= q nowhere exceeded, i.e. p == q: rejection had probability 0.
            emitted.append(_draw(residual if float(residual.sum()) > 0 else p, gen))
            break
        else:
            emitted.append(_draw(probs[base + k], gen))
        out.append(emitted)
    return out, [tree_paths.get(r, list(range(len(e) - 1))) for r, e in enumerate(out)]
