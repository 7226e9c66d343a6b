"""Request and response bodies in OpenAI's shapes, plus vLLM's sampling extras.

Unknown fields are ignored (as OpenAI and vLLM do) so newer clients keep working; known fields of
the wrong type fail pydantic validation, which the app turns into a 400.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from pagoda.model.tokenizer import iter_strings
from pagoda.sampling_params import SamplingParams
from pagoda.structured.params import StructuredOutputsParams
from pagoda.tools import ToolRequest, parse_tools

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
# vLLM's `priority`: under --scheduling-policy priority a lower value is served first. Bounded to 32 bits.
Priority = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _valid_unicode(value: Any, info: ValidationInfo) -> Any:
    """JSON can spell a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or UTF-8 encoder takes."""
    for text in iter_strings(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone UTF-16 surrogate, which is not valid Unicode text") from None
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")
    _unicode = field_validator("*", mode="after")(_valid_unicode)


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Model):
    """Fields both endpoints share; OpenAI's first, then vLLM's extras."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # keeps this tenant's prefix-cache entries apart
    priority: Priority = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _structured(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field names it (ValueError if several do)."""
        named = {"structured_outputs": self.structured_outputs} if self.structured_outputs else {}
        guided = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if v is not None}
        if guided:
            named["guided_*"] = guided
        fmt = self.response_format or {}
        kind = fmt.get("type")
        if kind == "json_object":
            named["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format: json_schema.schema must be a JSON schema object")
            named["response_format"] = {"json": schema}
        elif kind not in (None, "text"):
            raise ValueError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")
        if len(named) > 1:
            raise ValueError(f"structured_outputs: give one constraint, got {' and '.join(named)}")
        if not named:
            return None
        (fields,) = named.values()
        unknown = set(fields) - set(StructuredOutputsParams.__dataclass_fields__)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
        return StructuredOutputsParams(**fields)

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build SamplingParams; raises ValueError naming the bad parameter."""
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self._structured(),
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, so as strings."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias: keys must be token ids") from None


# ---- /v1/completions --------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    # StrictInt: a JSON true is not token id 1.
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (must equal n)")
        params = self._sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # echoed prompt tokens carry logprobs too
        return params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class CompletionLogprobs(_Model):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# Streaming chunks of /v1/completions share the response shape (object "text_completion").
CompletionStreamResponse = CompletionResponse


# ---- /v1/chat/completions ---------------------------------------------------------------------
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass to the template
    role: str
    content: str | list[dict[str, Any]] | None = None
    _unicode = field_validator("*", mode="after")(_valid_unicode)

    @model_validator(mode="after")
    def _extra_unicode(self) -> "ChatMessage":
        _valid_unicode(self.model_extra, None)  # type: ignore[arg-type]
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: content part of type {part.get('type')!r} is not supported "
                                 "(text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def tool_request(self) -> ToolRequest | None:
        return parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise ValueError("messages must not be empty")
        out = []
        for m in self.messages:
            d = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
            d.update(role=m.role, content=m.text())
            out.append(d)
        return out


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatLogprob] | None = None


class FunctionCall(_Model):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Model):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Model):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatStreamChoice(_Model):
    index: int
    delta: dict[str, Any]  # {"role", "content", "tool_calls"}: only the keys that changed
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# ---- models, tokenizer, errors ------------------------------------------------------------------
class ModelPermission(_Model):
    """vLLM lists one of these per model (OpenAI's retired permission object); clients written against it
    read the fields."""
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_Model):
    """A model as vLLM's /v1/models lists it: OpenAI's fields, then root, parent, max_model_len, permission."""
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(_Model):
    """vLLM's /v1/load_lora_adapter body: a PEFT folder served under `lora_name`."""
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Model):
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(_Model):
    prompt: str


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


class AnthropicErrorInfo(_Model):
    type: str
    message: str


class AnthropicErrorResponse(_Model):
    """The error body of Anthropic's Messages routes."""
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
