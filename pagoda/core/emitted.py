"""Emitted: the step's ragged sampler output (vLLM v1's shape). Per sequence, the tokens it emits this step:
one for a sampled row, the accepted proposals and then the target's own token for a verified row. The
engine appends every group position by position, so that a stop truncates what follows it, and the scheduler
rolls back what was scheduled but not appended (Scheduler.update)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagoda.core.request import Sequence
from pagoda.layers.sampler import SamplerOutput


@dataclass
class Emitted:
    seqs: list[Sequence]
    token_ids: list[list[int]]  # per sequence, in order
    # (indices into seqs, position j) -> those sequences' token j with its logprobs, as one sampler output
    output_at: Callable[[list[int], int], SamplerOutput]

    @classmethod
    def sampled(cls, seqs: list[Sequence], out: SamplerOutput) -> "Emitted":
        """One token per sequence, from one sampler call."""
        return cls(seqs, [[t] for t in out.token_ids], lambda rows, _j: out.select(rows))
