"""Request and response bodies of the OpenAI-compatible REST API.

Requests are validated strictly (a string where a number belongs is a 400, not a silent
coercion) and unknown fields are ignored, as OpenAI clients send many optional ones.
Fields that would change the output in a way SuperInfer cannot honour (suffix) are
rejected by name instead of being ignored, so a client never gets a result that
silently differs from what it asked for (gateway/conversion.py, which checks such
combinations and turns a body into the gateway's internal request). Sampling fields follow OpenAI's ranges and
vLLM's extras: n and best_of up to 32 choices, penalties (presence and frequency in
[-2, 2], repetition in (0, 2]), logit_bias (at most 300 token ids, values in [-100, 100]),
logprobs / top_logprobs up to 20, echo, structured outputs (`response_format` and
vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), and function
calling (`tools`, `tool_choice`, `parallel_tool_calls`: gateway/tools.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
# Each token checks every stop string's prefixes against the text's end (O(length^2)):
# a long one would stall the event loop that serves every stream.
MAX_STOP_STRING_CHARS = 256
MAX_CHOICES = 32  # n and best_of (the scheduler's limit too)
MAX_LOGPROBS = 20  # top logprobs per token
MAX_LOGIT_BIAS = 300  # token ids one logit_bias may name, as OpenAI allows

# OpenAI's newer name for the system role.
_ROLE_ALIASES = {"developer": "system"}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SLOSpec(_Request):
    """SuperInfer extra: this request's own latency targets (0 or absent: server default)."""

    ttft_ms: float | None = Field(None, ge=0, le=3.6e6)
    tbt_ms: float | None = Field(None, ge=0, le=3.6e6)


class StreamOptions(_Request):
    include_usage: bool = False


class JSONSchemaFormat(_Request):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extra; -1 and 0 mean off
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Any = None  # a string or a list of strings; checked below for a clear message
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extra
    slo: SLOSpec | None = None  # extra
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)  # vLLM's extra
    # vLLM's extra: lower is served first; a tenant's requests are bounded by its own.
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)
    # SuperInfer's extra: false turns speculative decoding off for this request (it
    # speculates where the server does, --speculative-config).
    speculative: bool = True
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras.
    guided_json: Any = None  # a JSON schema (an object, or its JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # a Lark grammar

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
        for key, value in v.items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for "
                                 f"token {key}")
        return v

    @property
    def num_choices(self) -> int:
        return self.n or 1

    # -- logprobs: the two APIs name them differently -------------------------------
    def top_logprobs_wanted(self) -> int | None:
        """Top logprobs per sampled token (0: the token's own only); None: no logprobs."""
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> str | list[str] | None:
        if v is None:
            return v
        if isinstance(v, str):
            check_stop_lengths([v])
            return v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        check_stop_lengths(v)
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def check_stop_lengths(stop: list[str]) -> None:
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(
            f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters, got {longest}")


class CompletionRequest(SamplingRequest):
    # A string, a list holding one string, or token ids (flat or one nested list); the
    # shapes are told apart in conversion.py, which gives a clearer error than a union.
    prompt: Any = Field(...)
    echo: bool | None = False
    suffix: str | None = None
    # Legacy completions: the number of top logprobs per token (0: the token's own only).
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(_Request):
    name: str = Field(..., pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None  # the schema is always enforced where it is (named, required)


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: str
    # A string, or a list of {"type": "text", "text": ...} parts (checked below).
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @field_validator("role")
    @classmethod
    def _check_role(cls, v: str) -> str:
        v = _ROLE_ALIASES.get(v, v)
        if v not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"role {v!r} is not supported; use system, user, assistant or tool")
        return v

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: Any) -> str | list[dict[str, str]] | None:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of text parts")
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part of type {kind!r} is not supported; only text parts")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)

    def openai(self) -> dict[str, Any]:
        """The message as a chat template reads it: role, text, and its tool fields."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[ToolDef] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(_Response):
    """The legacy completions shape: parallel lists, one entry per token (echo: the first
    prompt token has no logprob, null)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaToolCall(_Response):
    """A call in a stream: sent whole, once (its arguments in one piece)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatDelta(_Response):
    """Only the fields that changed, as OpenAI sends them (the final delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "superinfer"
    max_model_len: int  # vLLM's extra field; clients use it to size prompts
    # What a request's unset sampling fields become (--generation-config), and from where
    generation_defaults: dict[str, Any] | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
