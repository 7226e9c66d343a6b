"""llguidance (Guidance's Rust engine): a grammar compiles almost at once, since its lexer is built lazily
as tokens come; each step's mask is computed by walking the vocabulary's token trie."""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagoda.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (", " and ": "), as the xgrammar backend: free whitespace lets small models loop on spaces.
# Defaults, so a schema's own "x-guidance" options still win.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class GuidanceGrammar:
    """A checked grammar and a matcher at its start, which each new sequence copies (cheaper than building)."""
    grammar: str
    start: Any  # llguidance.LLMatcher, never advanced itself


class GuidanceMatcher:
    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._m, self._stop = matcher, stop_token_ids
        # A stop token is kept here, not given to llguidance: it records one only where the grammar could
        # still go on, so rolling it back would otherwise undo a different number of tokens.
        self._terminated = False
        self.jump_forward = True

    def accept(self, token_id: int) -> bool:
        if int(token_id) in self._stop:
            self._terminated = bool(self._m.is_accepting())
            return self._terminated
        # try_consume_tokens leaves the state as it was on a forbidden token (consume_token would poison it).
        return bool(self._m.try_consume_tokens([int(token_id)]) == 1)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_completed(self) -> bool:
        return bool(self._m.is_accepting())

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_string(self) -> str:
        if not self.jump_forward:
            return ""
        # Forced bytes may end inside a UTF-8 character: keep whole characters only.
        return codecs.getincrementaldecoder("utf-8")().decode(self._m.compute_ff_bytes())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._terminated:  # a stop token is always the last one accepted
            self._terminated, num_tokens = False, num_tokens - 1
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def fork(self) -> GuidanceMatcher:
        copy = GuidanceMatcher(self._m.deep_copy(), self._stop)
        copy._terminated, copy.jump_forward = self._terminated, self.jump_forward
        return copy


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast  # llguidance reads the vocabulary from it

        self._llg = llguidance
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(stop_token_ids))
        self.vocab_size = vocab_size
        self._stop = frozenset(stop_token_ids)
        # One thread, as the xgrammar backend: on a CPU engine more threads contend with torch's own.
        self._executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        kind = params.kind
        try:
            grammar = self._grammar(params)
            start = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)  # checks the grammar
            error = start.get_error() if start.is_error() else ""
        except Exception as e:  # whatever the library raises, the constraint is the client's: a 400
            error = str(e) or type(e).__name__
        if error:
            raise ValueError(f"structured_outputs: the {kind} does not compile: {_reason(error)}")
        return GuidanceGrammar(grammar, start)

    def compile_serialized(self, params: StructuredOutputsParams) -> str:
        return self.compile(params).grammar

    def deserialize(self, text: str) -> GuidanceGrammar:
        return GuidanceGrammar(text, self._llg.LLMatcher(self._tokenizer, text, log_level=0))

    def size_bytes(self, compiled: GuidanceGrammar) -> int:
        return len(compiled.grammar)  # the lexer grows as tokens come, in each matcher: not the cache's

    def _grammar(self, params: StructuredOutputsParams) -> str:
        """The constraint as llguidance's grammar text (checked when a matcher is built from it)."""
        m, kind = self._llg.LLMatcher, params.kind
        if kind == "json":
            try:
                schema = json.loads(str(params.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON: {e}") from None
            return m.grammar_from_json_schema(_closed(schema), defaults=_JSON_OPTIONS)
        if kind == "json_object":  # OpenAI's json_object: any JSON object (not any JSON value)
            return m.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if kind == "regex":
            return m.grammar_from_regex(str(params.regex))
        if kind == "choice":  # Lark string literals: exactly these strings, nothing is a pattern
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                              for s in params.choice or []))
        if kind == "grammar":  # GBNF/EBNF rules read 'name ::= ...'; Lark's read 'name: ...'
            text = params.grammar or ""
            if "::=" in text:
                from llguidance.gbnf_to_lark import any_to_lark

                text = any_to_lark(text)
            return m.grammar_from_lark(text)
        tag = json.loads(str(params.structural_tag))
        if not (isinstance(tag, dict) and "structures" in tag):
            raise ValueError("the guidance backend reads structural tags in the triggers + structures form "
                             "only (xgrammar's newer format: use xgrammar or auto)")
        triggers = tag.get("triggers") or []
        tags = []
        for s in tag["structures"]:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structural_tag: no trigger begins {s['begin']!r}")
            tags.append(self._llg.StructTag(trigger=trigger, begin=s["begin"], grammar=_closed(s.get("schema", {})),
                                            end=s["end"]))
        # The triggers are plain text here (not control tokens): '<tool_call>' is several tokens in most vocabularies.
        return m.grammar_from_lark(self._llg.StructTag.to_grammar(tags, assume_special=False))

    def matcher(self, compiled: GuidanceGrammar) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.start.deep_copy(), self._stop)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        self._executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)],  # GuidanceMatchers
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # llguidance's own kernel goes through torch.compile, which a CPU engine should not wait for.
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, :logits.shape[1]]
        logits.masked_fill_(allowed == 0, float("-inf"))


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems")


def _closed(schema: Any, top: bool = True) -> Any:
    """The schema with xgrammar's strict defaults: an object that lists its properties allows no others, an
    array that lists its prefix items no more, unless the schema says otherwise. llguidance follows JSON
    Schema's open defaults, so the same schema would mean more under it than under xgrammar ("auto" may
    pick either), and a small model given room for extra keys tends to add them without end."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):  # its parts are intersected: closing each would exclude the others'
        out["allOf"] = [_closed(sub, top=False) for sub in out["allOf"]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = [_closed(sub) for sub in out[key]] if isinstance(out[key], list) else _closed(out[key])
    if top and "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


def _reason(message: str) -> str:
    """llguidance's multi-line error as one line: its first line and the regex parser's 'error:' line,
    without the position in the generated grammar (which is not the client's text)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return "invalid constraint"
    first = lines[0]
    if first.startswith("at ") and ": " in first:
        first = first.split(": ", 1)[1]
    detail = next((ln[len("error:"):].strip() for ln in lines[1:] if ln.startswith("error:")), "")
    return f"{first} {detail}".strip()
