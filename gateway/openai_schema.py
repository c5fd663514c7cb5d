"""Request and response bodies of the OpenAI-compatible REST API.

Requests are validated strictly (a string where a number belongs is a 400, not a silent
coercion) and unknown fields are ignored, as OpenAI clients send many optional ones.
Fields that would change the output in a way SuperInfer cannot honour (n > 1, logprobs,
penalties …) are rejected by name instead of being ignored, so a client never gets a
result that silently differs from what it asked for.
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
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
# Each token checks every stop string's prefixes against the text's end (O(length^2)):
# a long one would stall the event loop that serves every stream.
MAX_STOP_STRING_CHARS = 256

ChatRole = Literal["system", "user", "assistant"]
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


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # extra; -1 and 0 mean off
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Any = None  # a string or a list of strings; checked below for a clear message
    n: int | None = Field(None, ge=1, le=INT32_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extra
    slo: SLOSpec | None = None  # extra
    user: str | None = None

    # Accepted only at their no-op values; see unsupported().
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None

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

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something SuperInfer cannot do."""
        if self.n not in (None, 1):
            return "n", "only n=1 is supported: SuperInfer returns one choice per request; send n requests instead"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported; only best_of=1"
        if self.logprobs not in (None, False, 0) or self.top_logprobs not in (None, 0):
            return "logprobs", "logprobs are not supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                return name, f"{name} is not supported; leave it at 0"
        if self.repetition_penalty not in (None, 1.0):
            return "repetition_penalty", "repetition_penalty is not supported; leave it at 1"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


def check_stop_lengths(stop: list[str]) -> None:
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(
            f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters, got {longest}")


class CompletionRequest(SamplingRequest):
    # A string, a list holding one string, or token ids (flat or one nested list); the
    # shapes are told apart in prompts.py, which gives a clearer error than a union.
    prompt: Any = Field(...)
    echo: bool | None = False
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ChatMessage(_Request):
    role: str
    # A string, or a list of {"type": "text", "text": ...} parts (checked below).
    content: Any = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _check_role(cls, v: str) -> str:
        v = _ROLE_ALIASES.get(v, v)
        if v not in ("system", "user", "assistant"):
            raise ValueError(f"role {v!r} is not supported; use system, user or assistant")
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        return super().unsupported()

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


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(_Response):
    """Only the fields that changed, as OpenAI sends them (the final delta is ``{}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
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


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
