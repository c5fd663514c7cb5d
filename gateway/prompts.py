"""From a client's request to the scheduler's: prompt ids, sampling and SLO, validated.

REST and the client gRPC API share these functions, so both reject the same inputs with
the same messages. Everything the scheduler would refuse is caught here first, where the
error can still name the offending field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from common.contracts import Grammar
from common.errors import SuperInferError
from common.generation_defaults import GenerationDefaults
from common.grammar import GrammarError, check
from common.tokenizer import Tokenizer
from common.wire import grammar_to_proto
from gateway.errors import APIError, from_superinfer, invalid
from gateway.openai_schema import INT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS, ChatMessage, SLOSpec
from gateway.tools import NO_TOOLS, ToolMode, prompt_messages, template_speaks_tools
from proto import common_pb2

T = TypeVar("T")

# Prompts longer than this (characters) are tokenized off the event loop, so one huge
# prompt does not stall every other stream.
_INLINE_TOKENIZE_CHARS = 16_384


async def tokenize(fn: Callable[..., T], *args: Any, size: int) -> T:
    """Run a tokenizing function inline when small, in a worker thread when large."""
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling choices as the client gave them (None: not given)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top logprobs per sampled token; None: no logprobs
    prompt_logprobs: bool = False  # echo with logprobs
    grammar: Grammar | None = None
    grammar_param: str = "response_format"  # the field that asked for it, for errors


def check_grammar(g: Grammar, param: str) -> None:
    """A grammar the library cannot compile is a 400 naming the problem."""
    try:
        check(g)
    except GrammarError as e:
        raise invalid(str(e), param=param, code="invalid_grammar") from None


def completion_prompt_ids(prompt: Any, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """A completions ``prompt``: text, ``[text]``, token ids or ``[[token ids]]``."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt is empty", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return check_token_ids(prompt, vocab_size, "prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid(
            "batched prompts are not supported; send one prompt per request", param="prompt"
        )
    raise invalid(
        "prompt must be a non-empty string, a list of one string, or a list of token ids",
        param="prompt",
    )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise invalid("prompt is empty", param=param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is out of range [0, {vocab_size})", param=param)
    return list(ids)


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer,
                    mode: ToolMode = NO_TOOLS) -> list[int]:
    """Render the conversation with the model's chat template (with the request's tools,
    gateway/tools.py), then encode it."""
    native = template_speaks_tools(tokenizer.chat_template)
    plain, variables = prompt_messages([m.openai() for m in messages], mode, native)
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, **variables)
    except SuperInferError as e:
        raise from_superinfer(e, param="messages") from e
    # The rendered text carries its own special tokens (BOS where the model wants one).
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise invalid("messages render to an empty prompt", param="messages")
    return ids


def sampling_params(
    s: Sampling, *, prompt_len: int, max_model_len: int, prompt_param: str = "prompt",
    vocab_size: int | None = None, defaults: GenerationDefaults | None = None,
) -> common_pb2.SamplingParams:
    """Unset fields from `defaults` (the model's, `--generation-config`; OpenAI's where
    None: temperature 1, top_p 1) and max_tokens up to the context limit."""
    d = defaults or GenerationDefaults()
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    max_tokens = room if s.max_tokens is None else s.max_tokens
    if not 1 <= max_tokens <= INT32_MAX:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    temperature = d.temperature if s.temperature is None else s.temperature
    top_p = d.top_p if s.top_p is None else s.top_p
    if not 0.0 <= temperature <= 100.0:
        raise invalid(f"temperature must be in [0, 100], got {temperature}", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = d.top_k if s.top_k is None else s.top_k
    if top_k < -1:
        raise invalid(f"top_k must be -1, 0 (off) or positive, got {top_k}", param="top_k")
    params = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        params.seed = s.seed
    _extras(s, params, vocab_size, d.repetition_penalty)
    return params


def _extras(s: Sampling, params: common_pb2.SamplingParams, vocab_size: int | None,
            default_repetition_penalty: float = 1.0) -> None:
    """Penalties, logit bias, logprobs and grammar, checked with messages naming the field
    (the REST schema checks the same ranges; the gRPC API arrives here unchecked)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise invalid(f"{name} must be in [-2, 2], got {v}", param=name)
    if s.repetition_penalty is not None and not 0.0 < s.repetition_penalty <= 2.0:
        raise invalid(f"repetition_penalty must be in (0, 2], got {s.repetition_penalty}",
                      param="repetition_penalty")
    params.presence_penalty = s.presence_penalty or 0.0
    params.frequency_penalty = s.frequency_penalty or 0.0
    params.repetition_penalty = s.repetition_penalty or default_repetition_penalty
    bias = s.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                      param="logit_bias")
    for tok, value in bias.items():
        if vocab_size is not None and not 0 <= tok < vocab_size:
            raise invalid(f"logit_bias token id {tok} is out of range [0, {vocab_size})",
                          param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise invalid(f"logit_bias values must be in [-100, 100], got {value} for token "
                          f"{tok}", param="logit_bias")
        params.logit_bias[tok] = value
    if s.logprobs is not None:
        if not 0 <= s.logprobs <= MAX_LOGPROBS:
            raise invalid(f"top logprobs must be in [0, {MAX_LOGPROBS}], got {s.logprobs}",
                          param="top_logprobs")
        params.logprobs = s.logprobs
    params.prompt_logprobs = s.prompt_logprobs
    if s.grammar is not None:
        check_grammar(s.grammar, s.grammar_param)
        params.grammar.CopyFrom(grammar_to_proto(s.grammar))


def slo(spec: SLOSpec | None) -> common_pb2.SLO:
    """Milliseconds from the client, seconds for the scheduler; 0 keeps the server default."""
    if spec is None:
        return common_pb2.SLO()
    return common_pb2.SLO(
        ttft_s=(spec.ttft_ms or 0.0) / 1000.0,
        tbt_s=(spec.tbt_ms or 0.0) / 1000.0,
    )
