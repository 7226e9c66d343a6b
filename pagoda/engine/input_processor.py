"""InputProcessor: the engine's front (vLLM v1's InputProcessor, SGLang's TokenizerManager).

Text in, a validated request out: its token ids, its resolved max_tokens and its grammar compiling. Every
entry point goes through it (LLM, the server's routes through AsyncEngine, the CLI), so each new route
reuses one tokenizer, one chat template and one set of checks; the engine core sees token ids only.
Thread-safe: the server calls it off its event loop.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagoda.model.tokenizer import Tokenizer, iter_strings
from pagoda.sampling_params import SamplingParams
from pagoda.structured.manager import StructuredOutputManager

# No token is longer than max_token_bytes; the slack covers normalizers that shrink text (NFKC).
_NORMALIZER_SLACK = 2


@dataclass
class ProcessedRequest:
    """What the engine core takes: a request checked against this model and engine."""
    prompt: str | None              # the text, where the request gave text
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                 # params.max_tokens, or what the context leaves
    grammar: Future | None          # the compiled constraint, done or compiling
    arrival_time: float             # when it came in (time.time()): queueing and time to first token count from it


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, structured: StructuredOutputManager, vocab_size: int,
                 max_model_len: int, max_num_seqs: int) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids. A text too long to fit max_model_len whatever its tokens are is refused before
        it is tokenized, so a huge prompt costs a length check, not seconds."""
        self._check_length(len(prompt))
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation's token ids through the chat template (message text never makes control tokens);
        `tools` go to templates that render them."""
        self._check_length(sum(len(t) for t in iter_strings([messages, tools])))
        return self.tokenizer.encode_chat(messages, add_generation_prompt, tools)

    def start_compile(self, params: SamplingParams) -> Future | None:
        """The request's grammar compiling (None without a constraint), cached by its text: a server awaits it
        without holding a thread. Its ValueError is the constraint's fault."""
        return None if params.constraint is None else self.structured.compile(params.constraint)

    def compile_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (blocking): a constraint that cannot compile raises ValueError
        here, so a caller can refuse it before queueing."""
        future = self.start_compile(params)
        if future is not None:
            future.result()

    def process(self, prompt: str | list[int], params: SamplingParams | None = None) -> ProcessedRequest:
        """Validate a request; raises ValueError for anything that can never run on this engine."""
        arrival = time.time()
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenize(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self._check_params(params)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but the model's context (max_model_len) is "
                             f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens")
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"max_tokens {max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        grammar = self.start_compile(params)
        if grammar is not None and grammar.done() and not grammar.cancelled() and grammar.exception() is not None:
            raise ValueError(str(grammar.exception()))
        return ProcessedRequest(text, ids, params, max_tokens, grammar, arrival)

    def _check_length(self, num_chars: int) -> None:
        limit = (self.max_model_len - 1) * self.tokenizer.max_token_bytes * _NORMALIZER_SLACK
        if num_chars > limit:
            raise ValueError(f"prompt is too long: {num_chars} characters cannot fit the model's context "
                             f"(max_model_len {self.max_model_len} tokens)")

    def _check_params(self, params: SamplingParams) -> None:
        """The parts of a request's validity that depend on this model and engine."""
        vocab, max_seqs = self.vocab_size, self.max_num_seqs
        if params.n > max_seqs:
            # The n samples run side by side, forked from one prompt: they must fit one step.
            raise ValueError(f"n must be at most max_num_seqs ({max_seqs}), got {params.n}")
        if any(t >= vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or {}):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size ({vocab}), got {value}")
