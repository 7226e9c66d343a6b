"""xgrammar (the backend of vLLM, SGLang and TRT-LLM): a C++ grammar compiler, matcher and CPU mask kernel."""
from __future__ import annotations

import json
from typing import Any

import torch

from pagoda.structured.params import StructuredOutputsParams


class XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self.jump_forward = True

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_completed(self) -> bool:
        return bool(self._m.is_completed())

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def forced_string(self) -> str:
        # xgrammar's search follows a forced path to its end, however long: only where limits.py bounds it.
        return str(self._m.find_jump_forward_string()) if self.jump_forward else ""

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fork(self) -> XGrammarMatcher:
        copy = XGrammarMatcher(self._m.fork())
        copy.jump_forward = self.jump_forward
        return copy


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast  # xgrammar reads the vocabulary's encoding from it

        self._xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._info = info
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        # One thread: the mask is filled between forward passes, and on a CPU engine more threads only
        # contend with torch's own (docs/benchmarks.md, "bench structured").
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> Any:
        c, kind = self._compiler, params.kind
        try:
            if kind == "json":
                # Compact JSON (", " and ": "): free whitespace lets small models loop on spaces.
                return c.compile_json_schema(str(params.json), any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: any JSON object (not any JSON value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(str(params.regex))
            if kind == "choice":
                return c.compile_regex("|".join(_regex_literal(s) for s in params.choice or []))
            if kind == "grammar":  # GBNF/EBNF rules read 'name ::= ...'; Lark's read 'name: ...'
                text = params.grammar or ""
                return c.compile_grammar(text) if "::=" in text else c.compile_lark(text)
            tag = json.loads(str(params.structural_tag))
            if isinstance(tag, dict) and "structures" in tag:  # vLLM's older form: triggers + structures
                items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})),
                                                     end=s["end"]) for s in tag["structures"]]
                return c.compile_structural_tag(items, tag["triggers"])
            return c.compile_structural_tag(str(params.structural_tag))
        except Exception as e:  # whatever the library raises, the constraint is the client's: a 400
            # xgrammar prefixes its C++ errors with a timestamp and a source path: keep the reason.
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "] " in reason and reason.startswith("["):
                reason = reason.split(": ", 1)[-1]
            raise ValueError(f"structured_outputs: the {kind} does not compile: {reason}") from None

    def compile_serialized(self, params: StructuredOutputsParams) -> str:
        return str(self.compile(params).serialize_json())

    def deserialize(self, text: str) -> Any:
        return self._xgr.CompiledGrammar.deserialize_json(text, self._info)

    def size_bytes(self, compiled: Any) -> int:
        return int(compiled.memory_size_bytes)

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask)  # XGrammarMatchers

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)


_REGEX_SPECIAL = frozenset(".^$*+?{}[]()|\\/")


def _regex_literal(text: str) -> str:
    """A regex matching exactly `text`: only regex metacharacters escaped (xgrammar rejects '\\ ')."""
    return "(" + "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text) + ")"
