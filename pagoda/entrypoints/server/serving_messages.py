"""POST /v1/messages (Anthropic's Messages API, what Claude Code and the Anthropic SDKs speak) and
POST /v1/messages/count_tokens.

A Messages request is read into the chat route's own request (system prompt, content blocks, tool_use and
tool_result blocks, tools and tool_choice), so it runs through the same template, checks, tool plan and
engine as /v1/chat/completions and gives the same tokens; only the shapes in and out are Anthropic's: the
message with its content blocks, streamed as Anthropic's named events, and errors as {"type": "error", ...}.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError, anthropic_error_body
from pagoda.entrypoints.server.serving import SentChoice, named_sse, text_of_parts
from pagoda.entrypoints.server.serving_chat import ChatServing, next_delta
from pagoda.outputs import CompletionOutput, RequestOutput


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: StrictInt
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    priority: P.Priority = 0  # not Anthropic's: vLLM's extra, as on every generation route

    def chat_request(self) -> P.ChatCompletionRequest:
        """The same request in the chat route's shape; ValueError (a 400) for what it cannot say."""
        tools = [_tool(t) for t in self.tools] if self.tools else None
        user = (self.metadata or {}).get("user_id")
        return P.ChatCompletionRequest(
            model=self.model, messages=_conversation(self.system, self.messages), max_tokens=self.max_tokens,
            stop=self.stop_sequences, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            tools=tools, tool_choice=_tool_choice(self.tool_choice, tools),
            parallel_tool_calls=not (self.tool_choice or {}).get("disable_parallel_tool_use", False),
            user=str(user) if user is not None else None, priority=self.priority)


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None

    def chat_request(self) -> P.ChatCompletionRequest:
        return MessagesRequest(model=self.model, messages=self.messages, system=self.system, tools=self.tools,
                               max_tokens=1).chat_request()


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


def _text_of(content: Any, where: str) -> str:
    return text_of_parts(content, where, ("text",))


def _conversation(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's turns as OpenAI chat messages: tool_use blocks become the assistant's tool_calls (arguments
    as JSON text), tool_result blocks become tool messages, text blocks the message's content."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        role, content, where = m.get("role"), m.get("content"), f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role must be user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content must be a string or a list of content blocks")
        text, calls, results = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ValueError(f"{at}: a tool_use block needs an id and a name")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ValueError(f"{at}: a tool_result block needs its tool_use_id")
                body = _text_of(block.get("content"), at)
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": f"Error: {body}" if block.get("is_error") else body})
            else:
                raise ValueError(f"{at}: a {kind or 'malformed'} block is not read here (text, tool_use from the "
                                 "assistant, tool_result from the user)")
        out.extend(results)  # a tool result answers the assistant's call just before it
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or not results:
            out.append({"role": role, "content": "".join(text)})
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ValueError("tools: each tool needs a name")
    if tool.get("type") not in (None, "custom"):
        raise ValueError(f"tools: the server tool {tool.get('type')!r} is not available here")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice: type must be auto, any, tool (with a name) or none, got {kind!r}")


def _stop(c: CompletionOutput, num_calls: int) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished completion in Anthropic's words."""
    if c.finish_reason is None:
        return None, None
    if num_calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _blocks(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    return blocks


class _BlockStream:
    """Anthropic's content-block events from the chat route's deltas: a text block while text comes, one
    tool_use block per call, each closed when the next opens or the message ends."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.call: int | None = None

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind, self.call = None, None
        return [{"type": "content_block_stop", "index": self.index}]

    def update(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("content"):
            if self.kind != "text":
                events += self._open({"type": "text", "text": ""})
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if self.kind != "tool_use" or call.get("index") != self.call:
                events += self._open({"type": "tool_use", "id": call.get("id") or P.random_id("toolu"),
                                      "name": function.get("name", ""), "input": {}})
                self.call = call.get("index")
            if function.get("arguments"):
                events.append({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}})
        return events


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat
        self.s = chat.s

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        self.s.check_model(req.model)
        try:
            chat_req = req.chat_request()
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        _, _, conversation, template_tools = self.chat._prepare(chat_req)
        ids = await self.s.chat_prompt(conversation, True, template_tools)
        return {"input_tokens": len(ids)}

    async def create(self, req: MessagesRequest, request: Request) -> Any:
        s = self.s
        try:
            chat_req = req.chat_request()
        except ValueError as e:
            raise APIError(400, str(e), "messages") from e
        model = s.check_model(req.model)
        msg_id = P.random_id("msg")
        params, plan, prompt_ids, queued = await self.chat.start(chat_req, request, msg_id)

        if not req.stream:
            (out,) = await s.collect(request, queued)
            c = out.outputs[0]
            content, calls = (c.text, []) if plan is None else plan.parse(c.text)
            stop_reason, stop_sequence = _stop(c, len(calls))
            return MessagesResponse(id=msg_id, model=model, content=_blocks(content, calls), stop_reason=stop_reason,
                                    stop_sequence=stop_sequence,
                                    usage=AnthropicUsage(input_tokens=len(prompt_ids), output_tokens=len(c.token_ids)))

        sent = SentChoice()
        calls_stream = plan.stream() if plan is not None else None
        blocks = _BlockStream()
        start = {"type": "message_start", "message": MessagesResponse(
            id=msg_id, model=model, usage=AnthropicUsage(input_tokens=len(prompt_ids), output_tokens=0)).model_dump()}

        def events(_: int, out: RequestOutput) -> list[dict[str, Any]]:
            c = out.outputs[0]
            step = next_delta(c, params, sent, calls_stream)
            if step is None:
                return []
            delta, finished = step
            result = blocks.update(delta)
            if finished:
                stop_reason, stop_sequence = _stop(c, calls_stream.num_calls if calls_stream is not None else 0)
                result += blocks.close()
                result.append({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                  "stop_sequence": stop_sequence},
                               "usage": {"output_tokens": len(c.token_ids)}})
                result.append({"type": "message_stop"})
            return result

        return s.sse_response(s.stream_events(request, queued, events, [start], None, frame=named_sse,
                                              error=anthropic_error_body, done=None))


MESSAGES_PATH = "/v1/messages"
