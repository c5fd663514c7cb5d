"""`/v1/completions`, `/v1/chat/completions` and `/v1/models`.

Both generation routes turn the body into the gateway's internal request
(gateway/conversion.py: validation, tokens, sampling), then wait for the scheduler's first
event before answering: that way a scheduler refusal (400/429/503) is still a proper HTTP
status rather than an error inside a 200 event stream. After that, output streams as
OpenAI-format SSE chunks or is collected into one JSON response.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import pydantic_core
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common.contracts import TokenLogprob
from gateway import conversion, tools
from gateway import openai_schema as s
from gateway.backend import ModelState
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.generation import Choice, Delta, Generation
from gateway.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from gateway.streaming import SSE_HEADERS, SSEResponse, until_disconnect

router = APIRouter()

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _ctx(request: Request) -> GatewayContext:
    ctx: GatewayContext = request.app.state.ctx
    return ctx


@router.get("/v1/models")
async def list_models(request: Request) -> s.ModelList:
    ctx = _ctx(request)
    model = await ctx.backend.model()
    card = s.ModelCard(id=model.served_name, created=ctx.started, max_model_len=model.max_model_len,
                       generation_defaults=model.defaults.as_dict())
    return s.ModelList(data=[card])


@router.post("/v1/completions")
async def create_completion(body: s.CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    try:
        model = await ctx.backend.model()
        req = await conversion.from_completion(body, model)
        gen = _generation(ctx, request, model, req)
    except APIError:
        ctx.metrics.requests.labels("rejected").inc()
        raise
    fmt = _CompletionFormat(request, model, body, req.prompt_ids, req.prompt_text)
    return await _respond(request, body, gen, fmt)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: s.ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    try:
        model = await ctx.backend.model()
        req = await conversion.from_chat(body, model)
        gen = _generation(ctx, request, model, req)
    except APIError:
        ctx.metrics.requests.labels("rejected").inc()
        raise
    return await _respond(request, body, gen, _ChatFormat(request, model, body))


def _generation(ctx: GatewayContext, request: Request, model: ModelState,
                req: conversion.InternalRequest) -> Generation:
    return ctx.generation(model, req, request_id=request.state.request_id,
                          arrival=request.state.arrival,
                          tenant=getattr(request.state, "tenant", None))


async def _respond(request: Request, body: s.SamplingRequest, gen: Generation, fmt: _Format) -> Response:
    deltas = gen.stream()
    try:
        if not body.stream:
            await until_disconnect(request, _drain(deltas))
            return JSONResponse(fmt.response(gen).model_dump(mode="json"))
        first = await until_disconnect(request, _next(deltas))
    except BaseException:
        await deltas.aclose()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return SSEResponse(_sse(fmt, gen, first, deltas, include_usage), headers=SSE_HEADERS)


async def _next(deltas: AsyncIterator[Delta]) -> Delta | None:
    return await anext(deltas, None)


async def _drain(deltas: AsyncIterator[Delta]) -> None:
    async for _ in deltas:
        pass


async def _sse(
    fmt: _Format, gen: Generation, first: Delta | None, deltas: AsyncGenerator[Delta, None],
    include_usage: bool,
) -> AsyncIterator[str]:
    try:
        for chunk in fmt.opening(include_usage, len(gen.choices)):
            yield _event(chunk)
        delta = first
        while delta is not None:
            for chunk in fmt.chunks(delta, gen, include_usage):
                yield _event(chunk)
            delta = await anext(deltas, None)
        if include_usage:
            yield _event(fmt.usage_chunk(gen))
    except APIError as e:
        # Headers are gone already: the error becomes an event, as OpenAI and vLLM do.
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


# A text whose JSON the rest of a chunk (id, model) will not contain; where it does, the
# chunk is built per token as before.
_PLACEHOLDER = "\x00superinfer-text\x00"
_PLACEHOLDER_JSON = pydantic_core.to_json(_PLACEHOLDER).decode()


def _event(chunk: str) -> str:
    return f"data: {chunk}\n\n"


def _usage(gen: Generation) -> s.Usage:
    return s.Usage.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


def _visible(choice: Choice, texts: TokenTexts) -> int:
    """How many of the choice's tokens its text shows: after a stop string matched, the
    tokens from the one that starts past the text's end are cut, like the text."""
    if not choice.tracker.stopped:
        return len(choice.token_ids)
    end, offset = len(choice.text), 0
    for i, t in enumerate(choice.token_ids):
        if offset >= end:
            return i
        offset += len(texts.text(t))
    return len(choice.token_ids)


def _ranked(gen: Generation, n: int) -> list[Choice]:
    """The n choices to return: all of them, or best_of's n with the highest total
    logprob (OpenAI's "highest log probability per token" ranking, as vLLM did)."""
    if len(gen.choices) == n:
        return gen.choices
    return sorted(gen.choices, key=lambda c: -sum(lp.logprob for lp in c.logprobs))[:n]


class _Format:
    """How one API kind renders chunks and the final response."""

    def __init__(self, request: Request, model: ModelState, body: s.SamplingRequest,
                 prefix: str) -> None:
        self.id = f"{prefix}-{request.state.request_id}"
        self.model = model.served_name
        self.created = int(time.time())
        self.texts = TokenTexts(model.tokenizer)
        self.logprobs = body.top_logprobs_wanted() is not None
        self.n = body.num_choices
        self._templates: dict[tuple[Any, ...], tuple[str, ...]] = {}  # () where none

    def opening(self, include_usage: bool, n: int) -> list[str]:
        return []

    def chunks(self, delta: Delta, gen: Generation, include_usage: bool) -> list[str]:
        raise NotImplementedError

    def usage_chunk(self, gen: Generation) -> str:
        raise NotImplementedError

    def response(self, gen: Generation) -> s.CompletionResponse | s.ChatCompletionResponse:
        raise NotImplementedError

    @staticmethod
    def _dump(chunk: s.CompletionChunk | s.ChatCompletionChunk, include_usage: bool) -> str:
        # OpenAI sends "usage": null on every chunk only when usage was asked for.
        return chunk.model_dump_json(exclude=None if include_usage else {"usage"})

    def _templated(self, key: tuple[Any, ...], text: str,
                   build: Callable[[str], s.CompletionChunk | s.ChatCompletionChunk],
                   include_usage: bool) -> str:
        """``_dump(build(text), include_usage)``, byte for byte, without building the
        models per token: the chunk is dumped once per ``key`` with a placeholder text,
        and later chunks splice the text's JSON (pydantic's own string encoder) into it."""
        parts = self._templates.get(key)
        if parts is None:
            pieces = self._dump(build(_PLACEHOLDER), include_usage).split(_PLACEHOLDER_JSON)
            parts = self._templates[key] = tuple(pieces) if len(pieces) == 2 else ()
        if not parts:  # the placeholder is not unique in the chunk: no template
            return self._dump(build(text), include_usage)
        return parts[0] + pydantic_core.to_json(text).decode() + parts[1]


class _CompletionFormat(_Format):
    def __init__(self, request: Request, model: ModelState, body: s.CompletionRequest,
                 prompt_ids: list[int], prompt_text: str) -> None:
        super().__init__(request, model, body, "cmpl")
        self.echo = bool(body.echo)
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self._offsets: dict[int, int] = {}  # streaming: text sent so far per choice

    def _chunk(self, choices: list[s.CompletionChoice]) -> s.CompletionChunk:
        return s.CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)

    def _echo_logprobs(self, gen: Generation) -> tuple[list[int], list[TokenLogprob | None]]:
        lps: list[TokenLogprob | None] = [None, *gen.prompt_logprobs]
        lps += [None] * (len(self.prompt_ids) - len(lps))  # (only if some never came)
        return self.prompt_ids, lps[: len(self.prompt_ids)]

    def _logprobs(self, gen: Generation, ids: list[int], lps: list[TokenLogprob],
                  offset: int, with_echo: bool) -> s.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        all_ids: list[int] = []
        all_lps: list[TokenLogprob | None] = []
        if with_echo:
            all_ids, all_lps = self._echo_logprobs(gen)
            all_ids, all_lps = list(all_ids), list(all_lps)
            offset = 0
        all_ids += ids
        all_lps += lps
        return completion_logprobs(self.texts, all_ids, all_lps, offset)

    def chunks(self, delta: Delta, gen: Generation, include_usage: bool) -> list[str]:
        first = delta.index not in self._offsets
        offset = self._offsets.get(delta.index, 0)
        text = delta.text
        echo = self.echo and first
        if echo:
            text = self.prompt_text + text
        self._offsets[delta.index] = offset + len(text)
        if not self.logprobs and not echo:  # the common case, per token
            index, reason = delta.index, delta.finish_reason
            return [self._templated(
                ("text", index, reason, include_usage), text,
                lambda x: self._chunk([s.CompletionChoice(index=index, text=x, finish_reason=reason)]),
                include_usage)]
        choice = s.CompletionChoice(
            index=delta.index, text=text, finish_reason=delta.finish_reason,
            logprobs=self._logprobs(gen, delta.token_ids, delta.logprobs, offset, echo),
        )
        return [self._dump(self._chunk([choice]), include_usage)]

    def usage_chunk(self, gen: Generation) -> str:
        chunk = self._chunk([])
        chunk.usage = _usage(gen)
        return chunk.model_dump_json()

    def response(self, gen: Generation) -> s.CompletionResponse:
        choices = []
        for i, c in enumerate(_ranked(gen, self.n)):
            keep = _visible(c, self.texts)
            prefix = self.prompt_text if self.echo else ""
            choices.append(s.CompletionChoice(
                index=i, text=prefix + c.text, finish_reason=c.finish_reason,
                logprobs=self._logprobs(gen, c.token_ids[:keep], c.logprobs[:keep],
                                        0, self.echo),
            ))
        return s.CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=_usage(gen)
        )


class _ChatFormat(_Format):
    def __init__(self, request: Request, model: ModelState, body: s.ChatCompletionRequest) -> None:
        super().__init__(request, model, body, "chatcmpl")
        self.tools = conversion.tool_mode(body)
        self._streams: dict[int, tools.ContentStream] = {}  # streaming: per choice

    def _finish_reason(self, parsed: tools.Parsed, reason: str | None) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced (named) call ends
        # with "stop"; a call cut short keeps "length".
        if parsed.calls and reason == "stop" and self.tools.kind != "named":
            return "tool_calls"
        return reason

    def _message(self, c: Choice) -> tuple[s.ChatResponseMessage, str | None]:
        if not self.tools.active:
            return s.ChatResponseMessage(content=c.text), c.finish_reason
        parsed = tools.parse(self.tools, c.text)
        calls = [s.ToolCall(id=k.id, function=s.ToolCallFunction(name=k.name, arguments=k.arguments))
                 for k in parsed.calls] or None
        return (s.ChatResponseMessage(content=parsed.content, tool_calls=calls),
                self._finish_reason(parsed, c.finish_reason))

    def _chunk(self, choices: list[s.ChatChunkChoice]) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)

    def _logprobs(self, lps: list[TokenLogprob]) -> s.ChatLogprobs | None:
        return chat_logprobs(self.texts, lps) if self.logprobs else None

    def opening(self, include_usage: bool, n: int) -> list[str]:
        return [self._dump(self._chunk([s.ChatChunkChoice(
            index=i, delta=s.ChatDelta(role="assistant", content=""))]), include_usage)
            for i in range(n)]

    def chunks(self, delta: Delta, gen: Generation, include_usage: bool) -> list[str]:
        out = []
        text, stream = delta.text, None
        if self.tools.active:  # held back where a call may begin
            stream = self._streams.get(delta.index)
            if stream is None:
                stream = self._streams[delta.index] = tools.ContentStream(self.tools)
            text = stream.feed(text)
        if text and not self.logprobs:  # the common case, per token
            index = delta.index
            out.append(self._templated(
                ("content", index, include_usage), text,
                lambda x: self._chunk([s.ChatChunkChoice(index=index, delta=s.ChatDelta(content=x))]),
                include_usage))
        elif text or (self.logprobs and delta.logprobs):
            choice = s.ChatChunkChoice(index=delta.index, delta=s.ChatDelta(content=text),
                                       logprobs=self._logprobs(delta.logprobs))
            out.append(self._dump(self._chunk([choice]), include_usage))
        if delta.finish_reason is not None:
            reason: str | None = delta.finish_reason
            if stream is not None:
                parsed = stream.finish()
                reason = self._finish_reason(parsed, reason)
                calls = [s.DeltaToolCall(index=i, id=k.id, function=s.ToolCallFunction(
                    name=k.name, arguments=k.arguments)) for i, k in enumerate(parsed.calls)]
                if calls or parsed.content:
                    rest = s.ChatDelta(content=parsed.content, tool_calls=calls or None)
                    out.append(self._dump(self._chunk([s.ChatChunkChoice(
                        index=delta.index, delta=rest)]), include_usage))
            choice = s.ChatChunkChoice(index=delta.index, delta=s.ChatDelta(),
                                       finish_reason=reason)
            out.append(self._dump(self._chunk([choice]), include_usage))
        return out

    def usage_chunk(self, gen: Generation) -> str:
        chunk = self._chunk([])
        chunk.usage = _usage(gen)
        return chunk.model_dump_json()

    def response(self, gen: Generation) -> s.ChatCompletionResponse:
        choices = []
        for i, c in enumerate(_ranked(gen, self.n)):
            message, reason = self._message(c)
            choices.append(s.ChatChoice(
                index=i, message=message, finish_reason=reason,
                logprobs=self._logprobs(c.logprobs[: _visible(c, self.texts)])))
        return s.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=_usage(gen)
        )
