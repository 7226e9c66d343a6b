"""The seam between the engine and a grammar library: compile a constraint, match tokens, fill masks.

A backend turns StructuredOutputsParams into a compiled grammar once (cached by the manager), then makes
one Matcher per sequence. The engine only ever sees these two protocols, so a second library (llguidance)
plugs in beside xgrammar without touching the step loop.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from pagoda.structured.params import StructuredOutputsParams


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    jump_forward: bool  # whether forced_string searches at all (the manager decides: limits.py)

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False if the grammar forbids it (the state is unchanged)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (1 bit per token, 32 tokens per int32)."""

    def is_completed(self) -> bool:
        """What was accepted is a complete match (a stop token may come next)."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""

    def forced_string(self) -> str:
        """The longest text the grammar allows as the only continuation from here ('' if none)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative tokens)."""

    def fork(self) -> "Matcher":
        """An independent copy at the same position (a sibling of an n > 1 request)."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A compiled grammar; raises ValueError naming what is wrong with the constraint. Thread-safe."""

    def compile_serialized(self, params: StructuredOutputsParams) -> str:
        """compile(), as the library's own serialized text (for a compile in another process)."""

    def deserialize(self, text: str) -> Any:
        """The compiled grammar that compile_serialized wrote."""

    def size_bytes(self, compiled: Any) -> int:
        """Memory the compiled grammar holds (what the grammar cache counts)."""

    def matcher(self, compiled: Any) -> Matcher: ...

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor: ...

    def fill_bitmask(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        """bitmask[i] = what matchers[i] allows next, for all rows in one call (the library may thread it)."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set the logits of forbidden tokens to -inf, in place, row i by bitmask[i]."""


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The backend `name` ("xgrammar" or "guidance") over a `tokenizers.Tokenizer`; building one reads the
    whole vocabulary (about a second)."""
    if name == "xgrammar":
        from pagoda.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    from pagoda.structured.guidance_backend import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
