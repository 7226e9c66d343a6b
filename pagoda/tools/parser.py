"""Reading tool calls out of generated text, whole or while it streams.

A reader scans the text generated so far and splits it into content and calls. It runs again on the whole
text at every streamed update, so a call is never split by a chunk boundary: what it reports for a prefix
of the text is a prefix of what it reports for the whole (content held back where it may still turn out to
open a call, a call's arguments as the raw JSON text written so far). A call's `arguments` is the model's
own JSON text of the arguments object, so streamed fragments concatenate to exactly the final string.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

_DECODER = json.JSONDecoder()
# A call object as every format writes it: the name first, then its arguments ("parameters" in Llama 3's).
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SPECIAL = re.compile(r'[{}\[\]"]')
_STRING_END = re.compile(r'[\\"]')
_SPACE = re.compile(r"\s*")


@dataclass
class CallState:
    name: str | None  # None while the name is still being written
    arguments: str  # the raw JSON text of the arguments object so far
    done: bool  # the arguments object is complete


@dataclass
class Scan:
    content: str
    calls: list[CallState] = field(default_factory=list)


class Reader(Protocol):
    def scan(self, text: str, final: bool) -> Scan:
        """Content and calls in `text`. Not final: the text may go on, so an unfinished call is reported
        as it stands and text that may still open a call is held back. Final: an unfinished or malformed
        call is content."""


def _value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at text[start]; None if it is not closed yet."""
    depth, i = 0, start
    while True:
        m = _SPECIAL.search(text, i)
        if m is None:
            return None
        i, c = m.start(), m.group()
        if c == '"':  # skip the string, escapes included
            i += 1
            while True:
                s = _STRING_END.search(text, i)
                if s is None:
                    return None
                if s.group() == "\\":
                    i = s.start() + 2
                    continue
                i = s.start() + 1
                break
            continue
        depth += 1 if c in "{[" else -1
        i += 1
        if depth == 0:
            return i


def read_call(text: str, start: int, final: bool) -> tuple[CallState | None, int | None]:
    """The call object opening at text[start] ('{'), and the end of that object (None if not closed yet).
    None for the call if it cannot be one (its arguments are not an object, it has no name)."""
    m = _HEADER.match(text, start)
    if m is not None:
        name = json.loads(f'"{m.group(1)}"')
        args = m.end()
        if args == len(text):
            return CallState(name, "", False), None
        if text[args] != "{":
            return None, _value_end(text, start)
        args_end = _value_end(text, args)
        if args_end is None:
            return CallState(name, text[args:], False), None
        close = _SPACE.match(text, args_end).end()  # type: ignore[union-attr]
        if close == len(text):
            return CallState(name, text[args:args_end], True), None
        if text[close] == "}":
            return CallState(name, text[args:args_end], True), close + 1
    # Keys in another order, or more keys: read the whole object once it is closed.
    end = _value_end(text, start)
    if end is None:
        return (CallState(None, "", False) if not final else None), None
    try:
        obj = json.loads(text[start:end])
    except (json.JSONDecodeError, RecursionError):  # the model's text: not a call
        return None, end
    args_obj = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(obj.get("name"), str) or not isinstance(args_obj, dict):
        return None, end
    return CallState(obj["name"], json.dumps(args_obj, ensure_ascii=False), True), end


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text to hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _is_complete(call: CallState | None) -> bool:
    return call is not None and call.name is not None and call.done


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


@dataclass(frozen=True)
class TaggedReader:
    """Hermes / Qwen2.5: each call is one object inside <tool_call> ... </tool_call>; text around is content."""
    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        out, pos = Scan(""), 0
        parts: list[str] = []
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                parts.append(tail if final else tail[:len(tail) - _partial_suffix(tail, self.start)])
                break
            parts.append(text[pos:i])
            j = text.find(self.end, i)
            body_end = j if j >= 0 else len(text)
            k = _SPACE.match(text, i + len(self.start)).end()  # type: ignore[union-attr]
            body = text[:body_end]
            call, _ = (read_call(body, k, final or j >= 0) if k < body_end and text[k] == "{"
                       else (None if final or j >= 0 else CallState(None, "", False), None))
            if j < 0:  # the block is still open
                if not final:
                    out.calls.append(call or CallState(None, "", False))
                elif _is_complete(call):  # stopped right after the object (an end-of-turn token)
                    out.calls.append(call)  # type: ignore[arg-type]
                else:
                    parts.append(text[i:])
                break
            if _is_complete(call):
                out.calls.append(call)  # type: ignore[arg-type]
            else:
                parts.append(text[i:j + len(self.end)])
            pos = j + len(self.end)
        out.content = "".join(parts)
        return out


_LLAMA_CALL = re.compile(r'(?:<\|python_tag\|>\s*)?(\{\s*"name"\s*:)')
_TRAILING_TAG = re.compile(r"<\|python_tag\|>\s*$")


@dataclass(frozen=True)
class InlineJsonReader:
    """Llama 3.x: calls are bare {"name": ..., "parameters": {...}} objects (after <|python_tag|> when the
    special tokens are kept), several separated by ';'."""

    def scan(self, text: str, final: bool) -> Scan:
        out, pos = Scan(""), 0
        parts: list[str] = []
        while True:
            m = _LLAMA_CALL.search(text, pos)
            if m is None:
                tail = text[pos:]
                if not final:
                    # A trailing '{"na' may open a call, with the tag before it, and so may the tag alone.
                    brace = tail.rfind("{")
                    keep = len(tail) - _partial_suffix(tail, "<|python_tag|>")
                    if brace >= 0 and '{"name":'.startswith(re.sub(r"\s", "", tail[brace:])):
                        keep = brace
                    tag = _TRAILING_TAG.search(tail, 0, keep)
                    tail = tail[:tag.start() if tag else keep]
                parts.append(tail)
                break
            parts.append(text[pos:m.start()])
            call, end = read_call(text, m.start(1), final)
            if end is None:
                if not final:
                    out.calls.append(call or CallState(None, "", False))
                elif _is_complete(call):
                    out.calls.append(call)  # type: ignore[arg-type]
                else:
                    parts.append(text[m.start():])
                break
            if _is_complete(call):
                out.calls.append(call)  # type: ignore[arg-type]
                end = re.compile(r"\s*;?\s*").match(text, end).end()  # type: ignore[union-attr]
            else:
                parts.append(text[m.start():end])
            pos = end
        out.content = "".join(parts)
        return out


@dataclass(frozen=True)
class ArrayReader:
    """A JSON array of call objects: Mistral's after [TOOL_CALLS], and the whole output under
    tool_choice=required (tag '')."""
    tag: str = ""

    def scan(self, text: str, final: bool) -> Scan:
        i = text.find(self.tag) if self.tag else _SPACE.match(text).end()  # type: ignore[union-attr]
        if i < 0:
            hold = 0 if final else _partial_suffix(text, self.tag)
            return Scan(text[:len(text) - hold])
        out = Scan(text[:i] if self.tag else "")
        k = _SPACE.match(text, i + len(self.tag)).end()  # type: ignore[union-attr]
        if k == len(text):
            return out if not final else Scan(text)
        if text[k] != "[":  # not a call array: all of it is content
            return Scan(text)
        calls: list[CallState] = []
        pos = k + 1
        while True:
            pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
            if pos == len(text):
                break
            if text[pos] == "]":
                out.calls = calls
                out.content += text[pos + 1:]
                return out
            if calls and text[pos] == ",":
                pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
                if pos == len(text):
                    break
            if text[pos] != "{":
                return Scan(text) if final else Scan(out.content, calls)
            call, end = read_call(text, pos, final)
            if end is None:
                if not final:
                    calls.append(call or CallState(None, "", False))
                break
            if not _is_complete(call):
                return Scan(text) if final else Scan(out.content, calls)
            calls.append(call)  # type: ignore[arg-type]
            pos = end
        if final:  # the array never closed: keep the complete calls, or give the text back
            complete = [c for c in calls if _is_complete(c)]
            return Scan(out.content, complete) if complete else Scan(text)
        out.calls = calls
        return out


@dataclass(frozen=True)
class ArgumentsReader:
    """tool_choice names a function: the whole output is its arguments object."""
    name: str

    def scan(self, text: str, final: bool) -> Scan:
        args = text.strip() if final else text.lstrip()
        done = final and _valid_json(args)
        if final and not done:
            return Scan(text)
        return Scan("", [CallState(self.name, args, done)])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tidy_content(content: str, final: bool) -> str:
    """Content as sent: without the whitespace around calls (held back until more text follows it)."""
    return content.strip() if final else content.lstrip().rstrip()


class ToolCallStream:
    """The deltas of one choice's stream: content as it becomes certain, then for each call its id and
    name in one delta and its arguments in fragments. `incremental` (the call is grammar-constrained, so
    it will parse): arguments stream as written; otherwise a call goes out whole once it is complete."""

    def __init__(self, reader: Reader, incremental: bool, max_calls: int | None = None) -> None:
        self.reader, self.incremental, self.max_calls = reader, incremental, max_calls
        self._content = 0
        self._calls: list[tuple[str, int]] = []  # (id, length of the arguments sent)

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def update(self, text: str, final: bool) -> dict[str, Any]:
        """The delta for the text generated so far ({} when nothing new can be sent yet)."""
        scan = self.reader.scan(text, final)
        delta: dict[str, Any] = {}
        content = tidy_content(scan.content, final)
        if len(content) > self._content:
            delta["content"] = content[self._content:]
            self._content = len(content)
        calls = scan.calls[:self.max_calls]
        out = []
        for i, call in enumerate(calls):
            if call.name is None or not (self.incremental or call.done):
                break
            if i == len(self._calls):
                self._calls.append((new_call_id(), 0))
                out.append({"index": i, "id": self._calls[i][0], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            call_id, sent = self._calls[i]
            if len(call.arguments) > sent:
                frag = {"index": i, "function": {"arguments": call.arguments[sent:]}}
                if out and out[-1]["index"] == i:
                    out[-1]["function"]["arguments"] += frag["function"]["arguments"]
                else:
                    out.append(frag)
                self._calls[i] = (call_id, len(call.arguments))
        if out:
            delta["tool_calls"] = out
        return delta


def parse_calls(reader: Reader, text: str, max_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, tool_calls in OpenAI's response shape) of a finished output."""
    scan = reader.scan(text, final=True)
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in scan.calls[:max_calls]]
    return tidy_content(scan.content, True) or None, calls
