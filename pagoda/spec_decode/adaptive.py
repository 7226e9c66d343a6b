"""Adaptive speculation: how many tokens to propose for each request this step, if any.

Each request keeps an EMA of its per-token acceptance rate a, so k proposals are expected to emit
1 + a + a^2 + ... + a^k tokens. A step's time is modelled as overhead + c0 + c1 * T for T target
tokens (fitted online to measured forwards, starting from a start-up measurement), plus for model drafts
d0 + d1 * B per draft pass over B rows. Proposals are added greedily, most likely accepted first, while
each one's expected tokens per second of extra cost beats the step's tokens per second so far. On a
compute-bound CPU a large batch makes c1 * T dominate, and speculation switches itself off (vllm#4630).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class StepCostModel:
    """Target forward time ~ c0 + c1 * T, a least-squares line over decayed (T, seconds) observations that
    starts from two start-up measurements; speculation varies T from step to step, so the line keeps up
    with the context lengths and the machine's load of the moment."""
    c0: float                 # seconds per target forward, independent of its size (weights read, launch)
    c1: float                 # seconds per target token
    d0: float = 0.0           # seconds per draft pass
    d1: float = 0.0           # seconds per drafted token
    overhead: float = 0.0     # EMA of the rest of a step (scheduling, sampling, detokenizing)
    decay: float = 0.99
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, T, t, T^2, T*t

    def add_point(self, num_tokens: int, seconds: float, weight: float = 1.0) -> None:
        x, y = float(num_tokens), seconds
        self._sums = [self.decay * s + weight * v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]
        w, sx, sy, sxx, sxy = self._sums
        var = sxx / w - (sx / w) ** 2
        if var > 1e-6:
            self.c1 = max((sxy / w - sx * sy / w**2) / var, 1e-7)
            self.c0 = max(sy / w - self.c1 * sx / w, 1e-6)

    def forward_time(self, num_tokens: int) -> float:
        return self.c0 + self.c1 * num_tokens

    def observe(self, num_tokens: int, forward_s: float, step_s: float) -> None:
        if self.c0 > 0 and forward_s > 4 * self.forward_time(num_tokens):
            return  # an outlier (a kernel build on first use, a burst of other load) would wreck the fit
        self.add_point(num_tokens, forward_s)
        self.overhead = 0.9 * self.overhead + 0.1 * max(0.0, step_s - forward_s)


@dataclass
class AdaptivePolicy:
    cost: StepCostModel
    prior: float = 0.5        # acceptance rate assumed for a request not yet measured
    ema: float = 0.3          # weight of the newest verification
    recovery: float = 0.02    # per step without speculating, drift back toward the prior (to probe again)
    # A proposal must beat the step's rate by this factor: the cost model misses Python and kernel-path costs of
    # longer rows, which can make a full batch slower than no speculation, and a loss hurts more than a tie.
    margin: float = 1.5
    alpha: dict[int, float] = field(default_factory=dict)

    def choose(self, seq_ids: list[int], max_ks: list[int], other_tokens: int,
               level_sizes: list[list[int]] | None = None) -> list[int]:
        """k per candidate (decoding sequences). Prefill tokens sharing the step (`other_tokens`) are useful work
        of their own, so the bar a proposal must clear is the decode rate: tokens per second of a plain
        decode step over these sequences (counting prefill time there would make proposals look cheap).
        `level_sizes`: per candidate, its draft tree's nodes per depth (core/draft_tree.py), each depth costing
        that many tokens (None: chains, one each); a tree's acceptance is measured along the branch verification
        took, so a is its rate per depth."""
        ks = [0] * len(seq_ids)
        gain = float(len(seq_ids))  # tokens the step emits without speculation
        time = self.cost.overhead + self.cost.forward_time(len(seq_ids))
        heap = [(-self.alpha.get(s, self.prior), i) for i, (s, m) in enumerate(zip(seq_ids, max_ks)) if m > 0]
        heapq.heapify(heap)
        depth_open = 0  # draft passes needed so far
        while heap:
            neg, i = heapq.heappop(heap)
            g = -neg  # alpha^(k+1): the chance this extra proposal is accepted (and so emitted)
            w = level_sizes[i][ks[i]] if level_sizes else 1
            extra = w * (self.cost.c1 + self.cost.d1) + (self.cost.d0 if ks[i] + 1 > depth_open else 0.0)
            if g * time <= self.margin * gain * extra:
                break
            ks[i] += 1
            depth_open = max(depth_open, ks[i])
            gain += g
            time += extra
            if ks[i] < max_ks[i]:
                heapq.heappush(heap, (-g * self.alpha.get(seq_ids[i], self.prior), i))
        for s, k in zip(seq_ids, ks):
            if k == 0 and s in self.alpha:
                self.alpha[s] += self.recovery * (self.prior - self.alpha[s])
        return ks

    def update(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        """Per-token acceptance estimate from one verification (geometric: accepted / trials)."""
        if num_proposed <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_proposed else 0)
        rate = num_accepted / trials
        a = self.alpha.get(seq_id, self.prior)
        self.alpha[seq_id] = (1 - self.ema) * a + self.ema * rate

    def forget_except(self, live: set[int]) -> None:
        for s in [s for s in self.alpha if s not in live]:
            del self.alpha[s]
