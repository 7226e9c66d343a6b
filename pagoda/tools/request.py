"""A chat request's tools and tool_choice, validated, and the output constraint that enforces the choice.

`required` and a named function are enforced by a JSON schema (as vLLM does): a named function's output is
its arguments object, `required`'s is an array of {"name", "parameters"} calls. That works on every grammar
backend and whatever the model's own call syntax is. `auto` keeps the model's syntax and constrains each
call from its opening tag on (a structural tag, built by the format in formats.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pagoda.structured.params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object
    description: str | None = None

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's (and HF chat templates') shape."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: Literal["none", "auto", "required", "named"]
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls

    @property
    def calls_expected(self) -> bool:
        """Whether the output is read for calls at all (tool_choice none: it is not)."""
        return self.choice != "none" and bool(self.functions)

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)

    def forced_constraint(self) -> StructuredOutputsParams | None:
        """The JSON schema that `required` or a named function imposes on the whole output (None otherwise)."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.function(self.named or "").parameters)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


# Each tool's schema joins the request's grammar and its description the prompt: a list past this is no agent's.
MAX_TOOLS = 1024


def parse_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """Validate OpenAI's tools / tool_choice / parallel_tool_calls; None when the request has no tools.
    Raises ValueError naming the field that is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: requires tools")
        return None
    if len(tools) > MAX_TOOLS:  # counted before any tool is read
        raise ValueError(f"tools: at most {MAX_TOOLS} tools per request, got {len(tools)}")
    functions: list[Function] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name: {name!r} is defined twice")
        names.add(name)
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters: must be a JSON schema of type object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description: must be a string")
        functions.append(Function(name, params, description))
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolRequest(tuple(functions), tool_choice or "auto", parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice: names function {name!r}, which is not in tools")
        return ToolRequest(tuple(functions), "named", name, parallel)
    raise ValueError("tool_choice: must be 'none', 'auto', 'required' or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
