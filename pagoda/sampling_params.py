"""SamplingParams: what a request asks of the sampler (vLLM's names and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagoda.structured.params import StructuredOutputsParams

# Integers the engine hands to torch must fit int64 (seeds: torch.Generator's signed range).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    # A JSON schema, regex, choice or grammar the output must match (pagoda.structured); a dict of its fields.
    structured_outputs: StructuredOutputsParams | dict | None = None

    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """structured_outputs as StructuredOutputsParams (__post_init__ turns a dict into one)."""
        assert not isinstance(self.structured_outputs, dict)
        return self.structured_outputs

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Reject what no engine can run: wrong types, non-finite floats, out-of-range integers.

        Limits that depend on the model or the engine (vocabulary ids, n against max_num_seqs, the
        context length) are checked by LLMEngine.add_request.
        """
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not INT64_MIN <= value <= INT64_MAX):
                raise bad(name, "must be a 64-bit integer")
        if self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be positive")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must not exceed max_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be non-negative")
        assert self.stop_token_ids is not None  # a list after __post_init__
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX
                    or isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100
                    for t, b in self.logit_bias.items()):
                raise bad("logit_bias", "must map token ids to biases in [-100, 100]")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError("stop strings must be non-empty strings")
