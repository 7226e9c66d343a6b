"""POST /v1/responses (OpenAI's Responses API, what its agents speak), GET and DELETE /v1/responses/{id}.

A Responses request is read into the chat route's own request (instructions, input items, function tools,
tool_choice, text.format, max_output_tokens), so it runs through the same template, checks, tool plan and
engine as /v1/chat/completions and gives the same tokens; only the shapes in and out differ: the response
with its output items, streamed as the documented `response.*` events. `store` (on by default, as OpenAI's)
keeps a response, with the conversation that led to it, in a bounded store that `previous_response_id`
continues from; the store forgets its oldest responses first and lives as long as the server.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, StrictInt

from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import APIError
from pagoda.entrypoints.server.serving import SentChoice, named_sse, text_of_parts
from pagoda.entrypoints.server.serving_chat import ChatServing, next_delta
from pagoda.outputs import CompletionOutput, RequestOutput

MAX_STORED_RESPONSES = 1024


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    priority: P.Priority = 0  # vLLM's extra, as on every generation route


@dataclass
class _Stored:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # the chat messages that led to it, its own answer included


class ResponseStore:
    """Responses kept for previous_response_id and GET, oldest forgotten first. Thread-safe."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, stored: _Stored) -> None:
        with self._lock:
            self._items[rid] = stored
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> _Stored:
        with self._lock:
            stored = self._items.get(rid)
        if stored is None:
            raise APIError(404, f"no stored response {rid!r} (stored responses are kept for the server's life, "
                                f"{self.capacity} at most)", "previous_response_id")
        return stored

    def delete(self, rid: str) -> None:
        self.get(rid)
        with self._lock:
            self._items.pop(rid, None)


def _content_text(content: Any, where: str) -> str:
    return text_of_parts(content, where, ("input_text", "output_text", "text"))


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages by role, function_call items as the assistant's tool_calls,
    function_call_output items as tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs its call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ValueError(f"{where}: items of type {kind!r} are not read here (message, function_call, "
                             "function_call_output)")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise ValueError("tools: only function tools (type function, with a name) are available here")
        function = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description") is not None:
            function["description"] = t["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError("tool_choice: auto, none, required, or {\"type\": \"function\", \"name\": ...}")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise ValueError(f"text.format: type must be text, json_schema or json_object, got {fmt.get('type')!r}")


def _output_items(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if content:
        items.append(_message_item(P.random_id("msg"), content))
    for call in calls:
        items.append(_call_item(P.random_id("fc"), call["id"], call["function"]["name"],
                                call["function"]["arguments"]))
    return items


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _assistant_turn(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages a response's output adds to its conversation."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat, self.s = chat, chat.s
        self.store = store or ResponseStore()

    def _chat_request(self, req: ResponsesRequest) -> tuple[P.ChatCompletionRequest, list[dict[str, Any]]]:
        history = self.store.get(req.previous_response_id).conversation if req.previous_response_id else []
        try:
            turns = _messages(req.input)
            messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + \
                [m for m in history if m["role"] != "system" or not req.instructions] + turns
            chat_req = P.ChatCompletionRequest(
                model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
                top_p=req.top_p, tools=_chat_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
                parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
                user=req.user, priority=req.priority)
        except ValueError as e:
            raise APIError(400, str(e), "input") from e
        return chat_req, messages

    def _body(self, rid: str, req: ResponsesRequest, model: str, created: int, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None,
              incomplete: str | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
                "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "text": req.text or
                {"format": {"type": "text"}}, "previous_response_id": req.previous_response_id,
                "store": req.store, "metadata": req.metadata or {}}

    @staticmethod
    def _usage(num_prompt: int, c: CompletionOutput) -> dict[str, Any]:
        return {"input_tokens": num_prompt, "output_tokens": len(c.token_ids),
                "total_tokens": num_prompt + len(c.token_ids), "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def get(self, rid: str) -> dict[str, Any]:
        return self.store.get(rid).body

    def delete(self, rid: str) -> dict[str, Any]:
        self.store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def create(self, req: ResponsesRequest, request: Request) -> Any:
        s = self.s
        model = s.check_model(req.model)
        chat_req, messages = self._chat_request(req)
        rid, created = P.random_id("resp"), int(time.time())
        params, plan, prompt_ids, queued = await self.chat.start(chat_req, request, rid)

        def finish(c: CompletionOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
            incomplete = "max_output_tokens" if c.finish_reason == "length" else None
            body = self._body(rid, req, model, created, "incomplete" if incomplete else "completed", output,
                              self._usage(len(prompt_ids), c), incomplete)
            if req.store:
                self.store.put(rid, _Stored(body, messages + _assistant_turn(output)))
            return body

        if not req.stream:
            (out,) = await s.collect(request, queued)
            c = out.outputs[0]
            content, calls = (c.text, []) if plan is None else plan.parse(c.text)
            return finish(c, _output_items(content, calls))

        seq = [0]
        sent = SentChoice()
        calls_stream = plan.stream() if plan is not None else None
        output: list[dict[str, Any]] = []  # items as they are when done
        current: dict[str, Any] = {}  # the open item: {"item": ..., "index": ..., "text" or "arguments"}

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            seq[0] += 1
            return {"type": kind, "sequence_number": seq[0] - 1, **fields}

        def close() -> list[dict[str, Any]]:
            if not current:
                return []
            item, index = current["item"], current["index"]
            events = []
            if item["type"] == "message":
                part = {"type": "output_text", "text": current["text"], "annotations": []}
                events += [event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=current["text"]),
                           event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part)]
                done = _message_item(item["id"], current["text"])
            else:
                events.append(event("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, arguments=current["arguments"]))
                done = _call_item(item["id"], item["call_id"], item["name"], current["arguments"])
            events.append(event("response.output_item.done", output_index=index, item=done))
            output.append(done)
            current.clear()
            return events

        def open_item(item: dict[str, Any], **state: Any) -> list[dict[str, Any]]:
            events = close()
            current.update(item=item, index=len(output), **state)
            events.append(event("response.output_item.added", output_index=current["index"], item=item))
            if item["type"] == "message":
                events.append(event("response.content_part.added", item_id=item["id"], output_index=current["index"],
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            return events

        def events_of(_: int, out: RequestOutput) -> list[dict[str, Any]]:
            c = out.outputs[0]
            step = next_delta(c, params, sent, calls_stream)
            if step is None:
                return []
            delta, finished = step
            events: list[dict[str, Any]] = []
            if delta.get("content"):
                if not current or current["item"]["type"] != "message":
                    events += open_item(_message_item(P.random_id("msg"), "", "in_progress"), text="")
                current["text"] += delta["content"]
                events.append(event("response.output_text.delta", item_id=current["item"]["id"],
                                    output_index=current["index"], content_index=0, delta=delta["content"]))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if not current or current["item"]["type"] != "function_call" or current["call"] != call.get("index"):
                    item = _call_item(P.random_id("fc"), call.get("id") or P.random_id("call"),
                                      function.get("name", ""), "", "in_progress")
                    events += open_item(item, arguments="", call=call.get("index"))
                if function.get("arguments"):
                    current["arguments"] += function["arguments"]
                    events.append(event("response.function_call_arguments.delta", item_id=current["item"]["id"],
                                        output_index=current["index"], delta=function["arguments"]))
            if finished:
                events += close()
                body = finish(c, output)
                events.append(event("response.completed" if body["status"] == "completed" else "response.incomplete",
                                    response=body))
            return events

        opening = self._body(rid, req, model, created, "in_progress", [], None)
        preamble = [event("response.created", response=opening), event("response.in_progress", response=opening)]
        return s.sse_response(s.stream_events(request, queued, events_of, preamble, None, frame=named_sse,
                                              error=_error_event, done=None))


def _error_event(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "code": str(status), "message": message, "param": None, "sequence_number": 0}
