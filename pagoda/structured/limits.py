"""What a constraint may ask before a grammar library sees it: cheap, linear checks that keep a 200-byte request
from running a compiler or a jump-forward search without end.

A JSON schema whose every instance is infinite (a required property that refers back to itself) or
astronomically long (`minItems: 10**9`) has no output the engine could ever finish; xgrammar's jump-forward
search follows such a forced path until memory runs out. `json_schema_sizes` computes, in one pass over the
schema, the length of the shortest instance of every subschema; the request is refused where that cannot fit in
the context, and jump-forward is left off where a forced path could be long enough to cost more than it saves.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

MAX_SCHEMA_DEPTH = 128  # nesting of the schema document itself (and of refs followed), past which it is refused
MAX_SCHEMA_VISITS = 200_000  # subschemas sized, refs followed again included: bounds the check's own work
# Strings of one `choice` list or `enum`: xgrammar's compile time grows faster than linearly with them
# (docs/reliability.md), and each compiled one is held in the cache.
MAX_ALTERNATIVES = 4096
# The longest shortest-instance of any subschema for which jump-forward runs: a forced path is never longer
# than the shortest way to finish the subschema it lies in.
JUMP_FORWARD_MAX_CHARS = 16384

_SCALAR_CHARS = {"integer": 1, "number": 1, "boolean": 4, "null": 4}


@dataclass(frozen=True)
class SchemaSizes:
    """`shortest`: characters of the schema's shortest instance (inf: none is finite); `largest_part`: the
    longest shortest-instance of any of its subschemas, which bounds every forced path inside it."""
    shortest: float
    largest_part: float


def json_schema_sizes(schema: Any) -> SchemaSizes:
    """The shortest instance of `schema` (a parsed JSON schema) and of its largest part, in compact JSON
    characters (a lower bound where keywords this ignores, such as pattern, would lengthen it). Raises
    ValueError for a schema nested deeper than MAX_SCHEMA_DEPTH or too large to check.

    Local refs are sized together, as a fixpoint: every ref starts infinite and each round sizes their targets
    with the last round's values, until nothing shrinks. A ref that needs itself (through required properties,
    items or allOf, with no other branch) stays infinite; one with a way out shrinks to its shortest."""
    walker = _Walker(schema, {})
    refs = walker.local_refs()
    walker.ref_sizes = dict.fromkeys(refs, math.inf)
    for _ in range(len(refs) + 1):
        new = {ref: walker.size(target, 0) for ref, target in refs.items()}
        if new == walker.ref_sizes:
            break
        walker.ref_sizes = new
    walker.largest = 0.0  # only the final sizes count
    for target in refs.values():
        walker.size(target, 0)
    shortest = walker.size(schema, 0)
    return SchemaSizes(shortest, max(walker.largest, shortest))


class _Walker:
    def __init__(self, root: Any, ref_sizes: dict[str, float]) -> None:
        self.root = root
        self.ref_sizes = ref_sizes  # each local ref's size in the current round
        self.largest = 0.0
        self.visits = 0

    def local_refs(self) -> dict[str, Any]:
        """Every '#...' ref used anywhere in the document that resolves, with its target."""
        found: dict[str, Any] = {}
        stack: list[tuple[Any, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            self._count(depth)
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref not in found:
                    target = self._resolve(ref)
                    if target is not None:
                        found[ref] = target
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
        return found

    def _count(self, depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        self.visits += 1
        if self.visits > MAX_SCHEMA_VISITS:
            raise ValueError(f"the JSON schema is too large or too recursive to check ({MAX_SCHEMA_VISITS} "
                             "subschemas visited)")

    def size(self, s: Any, depth: int) -> float:
        self._count(depth)
        if s is True or s == {}:
            return 1.0
        if s is False:
            return math.inf
        if not isinstance(s, dict):
            return 1.0  # not a schema: left to the compiler to refuse
        sizes = [self._own_size(s, depth)]
        ref = s.get("$ref")
        if isinstance(ref, str):
            sizes.append(self.ref_sizes.get(ref, 1.0))  # a remote or unknown ref: the compiler decides
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                sizes.append(min([self.size(b, depth + 1) for b in s[key]]))
        if isinstance(s.get("allOf"), list):
            sizes.extend(self.size(b, depth + 1) for b in s["allOf"])
        n = max(sizes)  # every part must hold at once: the longest shortest is a lower bound
        self.largest = max(self.largest, n)
        return n

    def _resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _own_size(self, s: dict, depth: int) -> float:
        if "const" in s:
            return float(len(json.dumps(s["const"], separators=(",", ":"))))
        if isinstance(s.get("enum"), list) and s["enum"]:
            check_alternatives(len(s["enum"]), "an enum")
            return float(min(len(json.dumps(v, separators=(",", ":"))) for v in s["enum"]))
        types = s.get("type")
        if types is None:
            types = "object" if "properties" in s or "required" in s else "array" if "items" in s else None
        if types is None:
            return 1.0
        if not isinstance(types, list):
            types = [types]
        return min((self._type_size(t, s, depth) for t in types), default=1.0)

    def _type_size(self, t: Any, s: dict, depth: int) -> float:
        if t in _SCALAR_CHARS:
            return float(_SCALAR_CHARS[t])
        if t == "string":
            return 2.0 + _count(s.get("minLength"))
        if t == "object":
            props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
            extra = s.get("additionalProperties", True)
            required = [r for r in s.get("required", []) if isinstance(r, str)] if isinstance(
                s.get("required"), list) else []
            n = 2.0
            for name in required:
                n += len(json.dumps(name)) + 1 + self.size(props.get(name, extra), depth + 1)
            for sub in props.values():  # optional properties may still be chosen: size them for largest_part
                self.size(sub, depth + 1)
            more = max(_count(s.get("minProperties")) - len(required), 0)
            n += more * 4  # "":0 at the least
            return n + max(len(required) + more - 1, 0)  # the commas
        if t == "array":
            prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
            items = s.get("items", True)
            want = _count(s.get("minItems"))
            n = 2.0 + max(want - 1, 0)  # the brackets and commas
            for i, sub in enumerate(prefix):
                k = self.size(sub, depth + 1)
                if i < want:
                    n += k
            rest = want - len(prefix)
            if rest > 0:
                n += rest * self.size(items, depth + 1)
            elif items is not True:
                self.size(items, depth + 1)
            return n
        return 1.0


def _count(v: Any) -> float:
    """A schema's minLength/minItems/minProperties as a number (a bad value counts as 0: the compiler refuses
    it)."""
    return float(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0.0


def check_alternatives(count: int, what: str) -> None:
    """Refuse a choice list or enum longer than MAX_ALTERNATIVES (ValueError naming the limit)."""
    if count > MAX_ALTERNATIVES:
        raise ValueError(f"structured_outputs: {what} of {count} strings; at most {MAX_ALTERNATIVES} are allowed")
