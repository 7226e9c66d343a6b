"""Prompt lookup (n-gram) proposals: the request's own prompt and output predict its continuation."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_propose(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """k tokens that followed the most recent earlier occurrence of the history's last n tokens, trying
    n from max_n down to min_n; [] when no suffix recurs. When the match is so recent that its continuation
    runs into the suffix, the proposal keeps repeating with the match's period (a loop stays a loop)."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start at 0..length-n-1 end before the suffix itself, so something follows them.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = length - start
            out = arr[start:start + k].tolist()
            while len(out) < k:
                out.append(out[len(out) - period])
            return out
    return []


class NgramProposer:
    """Proposes for a batch; q is a point mass, so no draft probabilities are returned."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[list[int]], ks: list[int]) -> list[list[int]]:
        return [ngram_propose(t, k, self.min_n, self.max_n) for t, k in zip(token_ids, ks)]
