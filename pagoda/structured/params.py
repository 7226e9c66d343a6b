"""StructuredOutputsParams: what a request asks its output to match (vLLM's names)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, dict or text), `regex`, `choice` (strings),
    `grammar` (EBNF/GBNF), `json_object` (any JSON object) or `structural_tag` (vLLM's
    triggers + structures form, which both backends read, or xgrammar's newer format)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text)")
        if isinstance(self.json, dict):  # frozen: store the canonical text, which is also the cache key
            object.__setattr__(self, "json", _dumps(self.json))
        if isinstance(self.structural_tag, dict):
            object.__setattr__(self, "structural_tag", _dumps(self.structural_tag))
        for name in ("regex", "grammar", "json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        return self.kind, _dumps(value) if isinstance(value, list) else str(value)


def _dumps(value: Any) -> str:
    # Key order is kept: a schema's property order is the order the output follows.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
