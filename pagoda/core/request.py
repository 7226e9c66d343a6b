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
    from concurrent.futures import Future

    from pagoda.lora.request import LoRARequest
    from pagoda.model.tokenizer import IncrementalDecoder
    from pagoda.structured.backend import Matcher


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
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify this step (speculative decoding)
    spec_parents: list[int] = field(default_factory=list)    # their tree (core/draft_tree.py); empty: a chain
    matcher: "Matcher | None" = None  # its grammar's state, for a structured-output request

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
    def arrival_order(self) -> tuple[int, int]:
        """Its place in arrival order, smaller first: its request's first sequence, then its sample index. Fixed
        for life, so a sequence preempted and readmitted keeps its age."""
        return self.request.seqs[0].seq_id, self.index



@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                 # resolved (params.max_tokens or what the context allows)
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    aborted: bool = False
    cache_salt: str | None = None   # isolates this tenant's prefix cache entries
    client: str | None = None       # whose share of the seats it takes (core/fairness.py); None = its own
    priority: int = 0               # served before higher values under the priority scheduling policy
    stop_ids: set[int] = field(default_factory=set)  # token ids that end a sequence (EOS unless ignored)
    error: str | None = None        # set when the engine failed this request (finish_reason "error")
    error_status: int = 500         # 400: the request's own fault (its constraint); 500: the engine's
    grammar: "Future | None" = None  # its compiled grammar (structured outputs), ready before it is scheduled
    lora_request: "LoRARequest | None" = None  # its adapter, or None: the base model
    lora_slot: int = -1             # the adapter slot it pinned (-1: none yet, or the base model)
    lora_key: str | None = None     # its adapter's digest: keys its prefix cache entries apart from others'
    arrival_time: float | None = None  # when it came in (the input processor's stamp); None: now

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time if self.arrival_time is not None else time.time())

    @property
    def finished(self) -> bool:
        # With n > 1 the siblings appear only after the prompt is computed (they fork from seq 0).
        return (len(self.seqs) == self.params.n or self.aborted) and all(s.finished for s in self.seqs)

    def prompt_logprobs_span(self, start: int, end: int) -> tuple[int, int] | None:
        """Prompt positions [first, last) of a chunk computing [start, end) whose logits still owe prompt
        logprobs (position p's logits score prompt token p+1); None when there are none. Robust to chunk
        boundaries that move when a preempted request is recomputed."""
        if self.prompt_logprobs is None:
            return None
        first, last = len(self.prompt_logprobs) - 1, min(end, len(self.prompt_token_ids) - 1)
        return (first, last) if start <= first < last else None


__all__ = ["Logprob", "Request", "SeqStatus", "Sequence"]
