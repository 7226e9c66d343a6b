"""POST /v1/chat/completions: a conversation through the chat template, OpenAI's chat completion out, whole
or streamed, with logprobs and tool calls (pagoda/tools); POST /v1/chat/completions/render: the prompt's token
ids."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, NamedTuple

from fastapi import Request

from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import bad_request
from pagoda.entrypoints.server.serving import SentChoice, Serving, chat_logprobs, visible_text
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tools import ToolPlan, choose_format, plan_tools, prepare_conversation, template_reads_tools
from pagoda.tools.parser import ToolCallStream


class Started(NamedTuple):
    """A conversation queued: its parameters, tool plan, prompt and the engine's queues for it."""
    params: SamplingParams
    plan: ToolPlan | None
    prompt_ids: list[int]
    queued: list[tuple[str, asyncio.Queue]]


def next_delta(c: CompletionOutput, params: SamplingParams, sent: SentChoice,
               calls: ToolCallStream | None) -> tuple[dict[str, Any], bool] | None:
    """What the one choice `c` adds since the last call, as a chat delta (text, or tool calls as each becomes
    certain), and whether it finished; None once it has. The Responses and Messages streams reshape this."""
    if sent.done:
        return None
    text = visible_text(c, params)
    finished = c.finish_reason is not None
    if calls is None:
        new = text[sent.text:]
        delta: dict[str, Any] = {"content": new} if new else {}
    else:
        delta = calls.update(text, finished)
    sent.advance(text, len(c.token_ids), finished)
    return delta, finished


def _finish_reason(c: CompletionOutput, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and c.finish_reason == "stop" else c.finish_reason


class ChatServing:
    """The chat route over the shared plumbing; the tool-call format is read from the template once."""

    def __init__(self, s: Serving, tool_call_parser: str | None) -> None:
        self.s = s
        template = getattr(s.tokenizer, "chat_template", None)
        self.tool_format = choose_format(tool_call_parser, template)
        self.native_tools = template_reads_tools(template)  # else pagoda/tools/formats.py describes the tools

    def _prepare(self, req: P.ChatCompletionRequest) -> tuple[Any, Any, list[dict[str, Any]], Any]:
        """The sampling parameters, tool plan, conversation and template tools of a request (400 if invalid)."""
        try:
            params = req.to_sampling_params()
            tools = req.tool_request()
            plan = plan_tools(tools, self.tool_format, params.structured_outputs)
            conversation, template_tools = prepare_conversation(req.conversation(), tools, self.tool_format,
                                                                self.native_tools)
        except ValueError as e:
            raise bad_request(e) from e
        if plan is not None:
            params = plan.apply(params)
        return params, plan, conversation, template_tools

    async def render(self, req: P.ChatCompletionRequest) -> dict[str, Any]:
        """vLLM's /v1/chat/completions/render: the prompt /v1/chat/completions would run, nothing generated."""
        model = self.s.check_model(req.model)
        params, _, conversation, template_tools = self._prepare(req)
        prompt_ids = await self.s.chat_prompt(conversation, req.add_generation_prompt, template_tools)
        return self.s.rendered(P.random_id("chatcmpl"), prompt_ids, params, model, bool(req.stream), req.cache_salt)

    async def start(self, req: P.ChatCompletionRequest, request: Request, base_id: str) -> Started:
        """Check, compile, render and queue a conversation: what every chat-shaped route (chat completions,
        Responses, Messages) does before it reads the outputs in its own shape."""
        s = self.s
        params, plan, conversation, template_tools = self._prepare(req)
        s.check_capacity(1)
        await s.compile_constraint(params, request)
        prompt_ids = await s.chat_prompt(conversation, req.add_generation_prompt, template_tools)
        queued = await s.submit([prompt_ids], params, base_id, req, request)
        return Started(params, plan, prompt_ids, queued)

    async def create(self, req: P.ChatCompletionRequest, request: Request) -> Any:
        s = self.s
        model = s.check_model(req.model)
        base_id = P.random_id("chatcmpl")
        params, plan, _, queued = await self.start(req, request, base_id)
        n = params.n
        top_n = req.top_logprobs or 0
        tokenizer = s.tokenizer

        if not req.stream:
            (out,) = await s.collect(request, queued)
            choices = []
            for c in out.outputs:
                content, calls = (c.text, []) if plan is None else plan.parse(c.text)
                message = P.ChatResponseMessage(content=content, tool_calls=calls or None)
                choices.append(P.ChatChoice(
                    index=c.index, message=message, finish_reason=_finish_reason(c, len(calls)),
                    logprobs=chat_logprobs(c.token_ids, list(c.logprobs or []), tokenizer, top_n)
                    if req.logprobs else None, stop_reason=c.stop_reason))
            return P.ChatCompletionResponse(id=base_id, model=model, choices=choices, usage=s.usage_of([out]))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent: defaultdict[int, SentChoice] = defaultdict(SentChoice)
        call_streams = {j: plan.stream() for j in range(n)} if plan is not None else {}
        created = P.ChatCompletionStreamResponse(id=base_id, model=model, choices=[]).created

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            body: dict[str, Any] = {"id": base_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": choices}
            if include_usage:
                body["usage"] = None
            return body

        # OpenAI opens every choice with the role and an empty content.
        preamble = [chunk([P.ChatStreamChoice(index=j, delta={"role": "assistant", "content": ""}).model_dump()
                           for j in range(n)])]

        def make_chunks(_: int, out: RequestOutput) -> list[dict[str, Any]]:
            result = []
            for c in out.outputs:
                so_far = sent[c.index]
                if so_far.done:
                    continue
                text = visible_text(c, params)
                finished = c.finish_reason is not None
                if plan is None:
                    new = text[so_far.text:]
                    delta: dict[str, Any] = {"content": new} if new else {}
                else:  # tool calls: content and calls as each becomes certain
                    delta = call_streams[c.index].update(text, finished)
                if not delta and not finished:
                    continue
                ntok = len(c.token_ids)
                start = so_far.advance(text, ntok, finished)
                lps = chat_logprobs(c.token_ids[start:ntok], list(c.logprobs or [])[start:ntok], tokenizer, top_n) \
                    if req.logprobs else None
                num_calls = call_streams[c.index].num_calls if plan is not None else 0
                result.append(chunk([P.ChatStreamChoice(
                    index=c.index, delta=delta, logprobs=lps, finish_reason=_finish_reason(c, num_calls),
                    stop_reason=c.stop_reason).model_dump()]))
            return result

        return s.sse_response(s.stream_events(request, queued, make_chunks, preamble,
                                              chunk if include_usage else None))
