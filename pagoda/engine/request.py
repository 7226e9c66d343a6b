"""Request state: a Request (one prompt, n samples) holds one Sequence per sample."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagoda.outputs import Logprob, PositionLogprobs, RequestMetrics
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.model.tokenizer import IncrementalDecoder


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, KV dropped; recomputed on resume
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    index: int                      # which of the request's n samples
    token_ids: list[int]            # prompt + output so far
    num_prompt_tokens: int
    num_computed_tokens: int = 0    # tokens whose KV is in the cache
    status: SeqStatus = SeqStatus.WAITING
    generator: torch.Generator | None = None
    decoder: "IncrementalDecoder | None" = None
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache at last admission

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_prompt(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                 # resolved (params.max_tokens or what the context allows)
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    aborted: bool = False
    cache_salt: str | None = None   # isolates this tenant's prefix cache entries

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def finished(self) -> bool:
        # With n > 1 the siblings appear only after the prompt is computed (they fork from seq 0).
        return (len(self.seqs) == self.params.n or self.aborted) and all(s.finished for s in self.seqs)

    def wants_prompt_logprobs(self, num_computed: int) -> bool:
        """True while the chunk starting at num_computed still has prompt logprobs to fill in."""
        return (self.params.prompt_logprobs is not None and self.prompt_logprobs is not None
                and len(self.prompt_logprobs) == num_computed + 1
                and num_computed + 1 < len(self.prompt_token_ids))


__all__ = ["Logprob", "Request", "SeqStatus", "Sequence"]
