"""The tool-call syntaxes models are trained on, and how a conversation with tools reaches the template.

Each format knows how its calls read (a Reader), the structural tag that constrains a call from its opening
text on under tool_choice=auto, and, for a chat template that has no tools section of its own (SmolLM2's
ChatML has none), how to describe the tools in the system message and write earlier calls and results back.
The format is picked once from the chat template's text, or named with --tool-call-parser.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagoda.tools.parser import ArrayReader, InlineJsonReader, Reader, TaggedReader
from pagoda.tools.request import Function, ToolRequest


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    reader: Reader
    markers: tuple[str, ...]  # text in a chat template that says the model writes this format
    trigger: str | None  # the text that opens a call (None: calls are not constrained under auto)
    begin: str  # a call's opening text up to its arguments; {name} is the function's name
    end: str  # what closes a call after its arguments
    separator: str  # between two calls written back into an assistant message
    instructions: str  # the system-message text for templates without tools; {tools} lists them
    keep_special_tokens: bool = False  # the call opens with a control token that must reach the text
    wrap: tuple[str, str] = ("", "")  # around the calls written back into an assistant message

    def structural_tag(self, functions: tuple[Function, ...]) -> dict[str, Any] | None:
        """Constrains each call from its trigger on (the form xgrammar's and llguidance's structural tags read)."""
        if self.trigger is None:
            return None
        return {"triggers": [self.trigger],
                "structures": [{"begin": self.begin.format(name=json.dumps(f.name)[1:-1]), "schema": f.parameters,
                                "end": self.end} for f in functions]}

    def write_calls(self, calls: list[tuple[str, str]]) -> str:
        """Earlier calls (name, arguments text) as the model would have written them."""
        written = self.separator.join(self.begin.format(name=json.dumps(n)[1:-1]) + a + self.end for n, a in calls)
        return self.wrap[0] + written + self.wrap[1]


HERMES = ToolCallFormat(
    "hermes", TaggedReader(), ("<tool_call>",), "<tool_call>",
    '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
LLAMA3_JSON = ToolCallFormat(
    "llama3_json", InlineJsonReader(), ("<|python_tag|>", "ipython"), '{"name": "',
    '{{"name": "{name}", "parameters": ', "}", "; ",
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format {{\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}}. Do not use variables.\n\n{tools}")
MISTRAL = ToolCallFormat(
    "mistral", ArrayReader("[TOOL_CALLS]"), ("[TOOL_CALLS]",), None,
    '{{"name": "{name}", "arguments": ', "}", ", ",
    "You can call these functions:\n{tools}\n\nTo call them, reply with [TOOL_CALLS] followed by a JSON "
    'array of {{"name": ..., "arguments": {{...}}}} objects.',
    keep_special_tokens=True, wrap=("[TOOL_CALLS] [", "]"))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def choose_format(name: str | None, template: str | None) -> ToolCallFormat:
    """--tool-call-parser NAME, else the format the chat template writes, else Hermes (the most common)."""
    if name:
        if name not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(FORMATS)}, got {name!r}")
        return FORMATS[name]
    for fmt in FORMATS.values():
        if template and any(m in template for m in fmt.markers):
            return fmt
    return HERMES


def template_reads_tools(template: str | None) -> bool:
    return bool(template and re.search(r"\btools\b", template))


def prepare_conversation(messages: list[dict[str, Any]], tools: ToolRequest | None, fmt: ToolCallFormat,
                         native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools for the template). `native`: the template renders tools, assistant tool_calls
    (arguments as objects, as HF templates expect) and tool messages itself. Otherwise the tools are described
    in the system message in `fmt`'s words, earlier calls are written into the assistant's text and tool
    results become user turns, so any template renders them and the model sees the syntax it is asked for."""
    offered = tools.functions if tools is not None and tools.calls_expected else ()
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        calls = _calls_of(m, i)
        if native:
            if calls:
                m = {**m, "tool_calls": [{**c, "function": {"name": n, "arguments": json.loads(a)}}
                                         for c, (n, a) in zip(m["tool_calls"], calls)]}
            out.append(m)
            continue
        if calls:
            text = m.get("content") or ""
            out.append({"role": m["role"], "content": (text + "\n" if text else "") + fmt.write_calls(calls)})
        elif m.get("role") == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if native:
        return out, [f.as_tool() for f in offered] or None
    if offered:
        listing = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in offered)
        block = fmt.instructions.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _calls_of(message: dict[str, Any], index: int) -> list[tuple[str, str]]:
    """An assistant message's tool_calls as (name, arguments text); ValueError naming what is malformed."""
    calls = message.get("tool_calls")
    if not calls:
        return []
    if message.get("role") != "assistant" or not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls: only an assistant message has a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}].function"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: must be an object with a name")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        try:
            if not isinstance(args, str) or not isinstance(json.loads(args), dict):
                raise ValueError
        except RecursionError:  # json's C parser nests by recursion: deep input is this request's 400
            raise ValueError(f"{where}.arguments: nested too deeply") from None
        except ValueError:
            raise ValueError(f"{where}.arguments: must be a JSON object (as text)") from None
        out.append((fn["name"], args))
    return out
