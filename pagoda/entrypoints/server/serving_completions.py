"""POST /v1/completions: prompts (text or token ids, one or many) in, OpenAI's legacy completion out, whole
or streamed, with echo and legacy logprobs; POST /v1/completions/render: the same prompts as token ids."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from fastapi import Request

from pagoda.entrypoints.server import protocol as P
from pagoda.entrypoints.server.errors import bad_request
from pagoda.entrypoints.server.serving import SentChoice, Serving, completion_logprobs, visible_text
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


def _join_logprobs(first: P.CompletionLogprobs, then: P.CompletionLogprobs) -> P.CompletionLogprobs:
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        setattr(first, key, getattr(first, key) + getattr(then, key))
    return first


def _parse(s: Serving, req: P.CompletionRequest) -> tuple[str, SamplingParams, list[str | list[int]]]:
    """The served model's name, the sampling params and the prompts of a request (400 for a bad value)."""
    model = s.check_model(req.model)
    try:
        return model, req.to_sampling_params(), req.prompts()
    except ValueError as e:
        raise bad_request(e) from e


async def create_completion(s: Serving, req: P.CompletionRequest, request: Request) -> Any:
    model, params, prompts = _parse(s, req)
    s.check_capacity(len(prompts))
    await s.compile_constraint(params, request)
    prompt_ids = await s.off_loop(s.tokenize_all, prompts)
    base_id = P.random_id("cmpl")
    queued = await s.submit(prompt_ids, params, base_id, req, request)
    n = params.n
    tokenizer = s.tokenizer
    prompt_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if req.echo else []

    def prompt_logprobs(out: RequestOutput) -> P.CompletionLogprobs:
        positions = list(out.prompt_logprobs or [None])
        positions += [None] * (len(out.prompt_token_ids) - len(positions))
        return completion_logprobs(out.prompt_token_ids, positions, tokenizer, 0)

    if not req.stream:
        outs = await s.collect(request, queued)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                text, lps = c.text, None
                if req.logprobs is not None:
                    lps = completion_logprobs(c.token_ids, list(c.logprobs or []), tokenizer,
                                              len(prompt_texts[i]) if req.echo else 0)
                if req.echo:
                    text = prompt_texts[i] + text
                    if lps is not None:
                        lps = _join_logprobs(prompt_logprobs(out), lps)
                choices.append(P.CompletionChoice(index=i * n + c.index, text=text, logprobs=lps,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return P.CompletionResponse(id=base_id, model=model, choices=choices, usage=s.usage_of(outs))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: defaultdict[int, SentChoice] = defaultdict(SentChoice)
    echoed: set[int] = set()

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = P.CompletionResponse(id=base_id, model=model, choices=[]).model_dump(exclude={"usage"})
        body["choices"] = choices
        if include_usage:
            body["usage"] = None
        return body

    def make_chunks(i: int, out: RequestOutput) -> list[dict[str, Any]]:
        result = []
        for c in out.outputs:
            idx = i * n + c.index
            so_far = sent[idx]
            if so_far.done:
                continue
            prefix, lps = "", None
            if req.echo and idx not in echoed:
                echoed.add(idx)
                prefix = prompt_texts[i]
                if req.logprobs is not None:
                    lps = prompt_logprobs(out)
            text = visible_text(c, params)
            delta = text[so_far.text:]
            if not delta and not prefix and c.finish_reason is None:
                continue  # e.g. half a UTF-8 character, or text held back for stop strings
            ntok = len(c.token_ids) if c.finish_reason is not None or delta else so_far.tokens
            offset = (len(prompt_texts[i]) if req.echo else 0) + so_far.text  # of the first new token
            start = so_far.advance(text, ntok, c.finish_reason is not None)
            if req.logprobs is not None:
                new = completion_logprobs(c.token_ids[start:ntok], list(c.logprobs or [])[start:ntok],
                                          tokenizer, offset)
                lps = new if lps is None else _join_logprobs(lps, new)
            result.append(chunk([P.CompletionChoice(index=idx, text=prefix + delta, logprobs=lps,
                                                    finish_reason=c.finish_reason,
                                                    stop_reason=c.stop_reason).model_dump()]))
        return result

    return s.sse_response(s.stream_events(request, queued, make_chunks, [], chunk if include_usage else None))


async def render_completion(s: Serving, req: P.CompletionRequest) -> list[dict[str, Any]]:
    """vLLM's /v1/completions/render: each prompt tokenized as /v1/completions would, nothing generated."""
    model, params, prompts = _parse(s, req)
    prompt_ids = await s.off_loop(s.tokenize_all, prompts)
    return [s.rendered(P.random_id("cmpl"), ids, params, model, bool(req.stream), req.cache_salt)
            for ids in prompt_ids]
