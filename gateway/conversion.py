"""From a client's request to the gateway's internal one, in one pass.

An OpenAI body (`/v1/completions`, `/v1/chat/completions`, its shapes checked by
gateway/openai_schema.py) or a client gRPC message (`proto/client.proto`) becomes an
`InternalRequest`: prompt token ids, the scheduler's `SamplingParams` (unset fields from
the model's `--generation-config`), SLO, the choices to generate and the stop strings. The
routes hand it to the generation machinery (`GatewayContext.generation`) and format what
comes back.

REST and gRPC share the checks, so both reject the same inputs with the same messages.
Everything the scheduler would refuse is caught here first, where the error can still name
the offending field.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from common.contracts import Grammar
from common.errors import SuperInferError
from common.generation_defaults import GenerationDefaults
from common.grammar import GrammarError, check
from common.tokenizer import Tokenizer
from common.wire import grammar_from_proto, grammar_to_proto
from gateway.backend import ModelState
from gateway.errors import APIError, from_superinfer, invalid
from gateway.openai_schema import (
    INT32_MAX,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    SLOSpec,
    check_stop_lengths,
)
from gateway.tools import (
    NO_PARAMETERS,
    NO_TOOLS,
    Function,
    ToolMode,
    prompt_messages,
    template_speaks_tools,
)
from gateway.tools import tool_mode as _tool_mode
from proto import client_pb2, common_pb2, scheduler_pb2

T = TypeVar("T")

# The scheduler checks each sampled token against them, so they are bounded like stop strings.
MAX_STOP_TOKEN_IDS = 64

# Prompts longer than this (characters) are tokenized off the event loop, so one huge
# prompt does not stall every other stream.
_INLINE_TOKENIZE_CHARS = 16_384


@dataclass(frozen=True, slots=True)
class InternalRequest:
    """A client's request, checked, as the gateway serves it."""

    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    slo: common_pb2.SLO
    stop: tuple[str, ...] = ()
    n: int = 1  # choices the scheduler generates (best_of's candidates included)
    prompt_text: str = ""  # what a completion's echo repeats
    priority: int = 0  # as asked; the tenant bounds it (gateway/tenants.py)
    tenant: str = ""  # set once the request's tenant is known
    weight: float = 1.0  # the tenant's
    speculative: bool = True  # False: the request turned speculative decoding off

    def scheduler_request(self, request_id: str) -> scheduler_pb2.GenerateRequest:
        return scheduler_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=self.prompt_ids, sampling=self.sampling,
            slo=self.slo, n=self.n if self.n > 1 else 0, priority=self.priority,
            tenant=self.tenant, weight=self.weight, no_speculation=not self.speculative,
        )


# -- REST: an OpenAI body ------------------------------------------------------------------


async def from_completion(body: CompletionRequest, model: ModelState) -> InternalRequest:
    check_model(body.model, model)
    check_supported(body)
    ids = await tokenize(completion_prompt_ids, body.prompt, model.tokenizer, model.vocab_size,
                         size=_size(body.prompt))
    echo = bool(body.echo)
    return _from_body(body, model, ids, body.max_tokens, "prompt", echo=echo,
                      prompt_text=_prompt_text(body.prompt, model, ids) if echo else "")


async def from_chat(body: ChatCompletionRequest, model: ModelState) -> InternalRequest:
    check_model(body.model, model)
    check_supported(body)
    ids = await tokenize(chat_prompt_ids, body.messages, model.tokenizer, tool_mode(body),
                         size=sum(len(m.text()) for m in body.messages))
    return _from_body(body, model, ids, body.requested_max_tokens, "messages")


def check_model(requested: str | None, model: ModelState) -> None:
    """Clients may omit the model (as vLLM allows); a wrong name is a 404."""
    if requested is not None and requested != model.served_name:
        raise APIError(
            404, f"The model '{requested}' does not exist; this server serves "
            f"'{model.served_name}'",
            param="model", code="model_not_found",
        )


def check_supported(body: SamplingRequest) -> None:
    """A field set to something SuperInfer cannot do, or to a combination that makes no
    sense, is a 400 naming the first such field."""
    problem = _unsupported(body)
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _unsupported(body: SamplingRequest) -> tuple[str, str] | None:
    if isinstance(body, CompletionRequest) and body.suffix:
        return "suffix", "suffix is not supported"
    if isinstance(body, ChatCompletionRequest):
        try:
            mode = tool_mode(body)
        except ValueError as e:
            return "tool_choice", str(e)
        if mode.constrained and body.best_of is not None:
            return "best_of", "best_of cannot rank tool calls"
        if body.top_logprobs is not None and not body.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if body.best_of is not None:
            return "best_of", "best_of is only supported on /v1/completions; use n"
    n = body.num_choices
    if body.stream_options is not None and not body.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    if body.best_of is not None and body.best_of < n:
        return "best_of", f"best_of must be at least n ({n}), got {body.best_of}"
    if body.stream and body.best_of is not None and body.best_of > n:
        return "best_of", "best_of > n cannot be streamed: the best choices are known only at the end"
    try:
        grammar(body)
    except ValueError as e:
        return "response_format", str(e)
    return None


def tool_mode(body: ChatCompletionRequest) -> ToolMode:
    """ValueError for a tool_choice that names nothing given (see gateway/tools.py)."""
    functions = [Function(t.function.name, t.function.description,
                          t.function.parameters or dict(NO_PARAMETERS))
                 for t in body.tools or ()]
    return _tool_mode(functions, body.tool_choice, body.parallel_tool_calls)


def grammar(body: SamplingRequest) -> tuple[str, Grammar] | None:
    """(the field that asked, the constraint) of the one structured-output field given;
    ValueError when several are. A named or required tool_choice constrains the output
    like a JSON schema (and then no other structured output may be given)."""
    if not isinstance(body, ChatCompletionRequest):
        return _structured_output(body)
    schema = tool_mode(body).schema()
    given = _structured_output(body)
    if schema is None:
        return given
    if given is not None:
        raise ValueError(f"tool_choice {body.tool_choice!r} constrains the output already; "
                         f"drop {given[0]}")
    return "tool_choice", Grammar("json_schema", json.dumps(schema))


def _structured_output(body: SamplingRequest) -> tuple[str, Grammar] | None:
    given: list[tuple[str, Grammar]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", Grammar("json_object", "")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        given.append(("response_format", Grammar("json_schema", json.dumps(rf.json_schema.schema_))))
    if body.guided_json is not None:
        spec = body.guided_json
        if not isinstance(spec, str | dict):
            raise ValueError("guided_json must be a JSON schema (an object or its text)")
        given.append(("guided_json", Grammar("json_schema",
                                             spec if isinstance(spec, str) else json.dumps(spec))))
    if body.guided_regex is not None:
        given.append(("guided_regex", Grammar("regex", body.guided_regex)))
    if body.guided_choice is not None:
        given.append(("guided_choice", Grammar("choice", json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        given.append(("guided_grammar", Grammar("lark", body.guided_grammar)))
    if len(given) > 1:
        raise ValueError("give at most one of response_format (json_object/json_schema), "
                         f"guided_json, guided_regex, guided_choice, guided_grammar; got "
                         f"{', '.join(p for p, _ in given)}")
    return given[0] if given else None


def _from_body(body: SamplingRequest, model: ModelState, ids: list[int], max_tokens: int | None,
               prompt_param: str, echo: bool = False, prompt_text: str = "") -> InternalRequest:
    wanted = body.top_logprobs_wanted()
    choices = body.best_of or body.num_choices
    # best_of ranks its candidates by their tokens' logprobs: it needs them even when the
    # client did not ask.
    logprobs = wanted if wanted is not None or choices == body.num_choices else 0
    g = grammar(body)
    sampling = sampling_params(
        Sampling(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, seed=body.seed, ignore_eos=bool(body.ignore_eos),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias={int(k): float(v) for k, v in (body.logit_bias or {}).items()},
            logprobs=logprobs, prompt_logprobs=echo and wanted is not None,
            grammar=g[1] if g else None, grammar_param=g[0] if g else "response_format",
        ),
        prompt_len=len(ids), max_model_len=model.max_model_len, prompt_param=prompt_param,
        vocab_size=model.vocab_size, defaults=model.defaults,
    )
    return InternalRequest(prompt_ids=ids, sampling=sampling, slo=slo(body.slo),
                           stop=body.stop_strings, n=choices, prompt_text=prompt_text,
                           priority=body.priority, speculative=body.speculative)


def _size(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return 0


def _prompt_text(prompt: Any, model: ModelState, ids: list[int]) -> str:
    """What echo repeats: the prompt as sent, or its ids decoded."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(ids)


# -- gRPC: a ClientGenerateRequest ---------------------------------------------------------


async def from_client(message: client_pb2.ClientGenerateRequest, model: ModelState) -> InternalRequest:
    """Proto3 scalars cannot say "not set": 0 is the default for max_tokens (up to the
    context limit), top_p and repetition_penalty (OpenAI's 1.0, not the model's
    --generation-config); temperature 0 is greedy."""
    check_model(message.model or None, model)
    if message.prompt and message.prompt_token_ids:
        raise invalid("give either prompt or prompt_token_ids, not both", "prompt")
    if len(message.stop) > MAX_STOP_STRINGS:
        raise invalid(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
    try:
        check_stop_lengths(list(message.stop))
    except ValueError as e:
        raise invalid(str(e), "stop") from None
    sp = message.sampling
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are supported", "stop_token_ids")
    if message.prompt:
        ids = await tokenize(model.tokenizer.encode, message.prompt, size=len(message.prompt))
    else:
        ids = check_token_ids(list(message.prompt_token_ids), model.vocab_size, "prompt_token_ids")
    if not 0 <= message.n <= MAX_CHOICES:
        raise invalid(f"n must be in [1, {MAX_CHOICES}], got {message.n}", "n")
    sampling = sampling_params(
        Sampling(
            max_tokens=sp.max_tokens or None, temperature=sp.temperature, top_p=sp.top_p or None,
            top_k=sp.top_k, seed=sp.seed if sp.HasField("seed") else None,
            ignore_eos=sp.ignore_eos, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty or None, logit_bias=dict(sp.logit_bias),
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            prompt_logprobs=sp.prompt_logprobs, grammar=grammar_from_proto(sp.grammar),
            grammar_param="grammar",
        ),
        prompt_len=len(ids), max_model_len=model.max_model_len, vocab_size=model.vocab_size,
    )
    bad_stop_id = next((t for t in sp.stop_token_ids if not 0 <= t < model.vocab_size), None)
    if bad_stop_id is not None:
        raise invalid(f"stop token id {bad_stop_id} is out of range", "stop_token_ids")
    sampling.stop_token_ids.extend(sp.stop_token_ids)
    if message.slo.ttft_s < 0 or message.slo.tbt_s < 0:
        raise invalid("SLOs must be >= 0 seconds (0: server default)", "slo")
    return InternalRequest(prompt_ids=ids, sampling=sampling, slo=message.slo,
                           stop=tuple(message.stop), n=message.n or 1,
                           priority=message.priority,
                           speculative=not message.no_speculation)


# -- prompt token ids ----------------------------------------------------------------------


async def tokenize(fn: Callable[..., T], *args: Any, size: int) -> T:
    """Run a tokenizing function inline when small, in a worker thread when large."""
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


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


# -- sampling and SLO ----------------------------------------------------------------------


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


def check_grammar(g: Grammar, param: str) -> None:
    """A grammar the library cannot compile is a 400 naming the problem."""
    try:
        check(g)
    except GrammarError as e:
        raise invalid(str(e), param=param, code="invalid_grammar") from None


def slo(spec: SLOSpec | None) -> common_pb2.SLO:
    """Milliseconds from the client, seconds for the scheduler; 0 keeps the server default."""
    if spec is None:
        return common_pb2.SLO()
    return common_pb2.SLO(
        ttft_s=(spec.ttft_ms or 0.0) / 1000.0,
        tbt_s=(spec.tbt_ms or 0.0) / 1000.0,
    )
