"""`/v1/completions`, `/v1/chat/completions` and `/v1/models`.

Both generation routes validate and tokenize, then wait for the scheduler's first event
before answering: that way a scheduler refusal (400/429/503) is still a proper HTTP
status rather than an error inside a 200 event stream. After that, output streams as
OpenAI-format SSE chunks or is collected into one JSON response.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway import openai_schema as s
from gateway import prompts
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.generation import Delta, Generation
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
    card = s.ModelCard(id=model.served_name, created=ctx.started, max_model_len=model.max_model_len)
    return s.ModelList(data=[card])


@router.post("/v1/completions")
async def create_completion(body: s.CompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    try:
        model = await ctx.backend.model()
        _precheck(ctx, body, model)
        ids = await prompts.tokenize(
            prompts.completion_prompt_ids, body.prompt, model.tokenizer, model.vocab_size,
            size=_size(body.prompt),
        )
        gen = _generation(ctx, request, body, model, ids, body.max_tokens, "prompt")
    except APIError:
        ctx.metrics.requests.labels("rejected").inc()
        raise
    return await _respond(request, body, gen, _CompletionFormat(request, model.served_name))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: s.ChatCompletionRequest, request: Request) -> Response:
    ctx = _ctx(request)
    try:
        model = await ctx.backend.model()
        _precheck(ctx, body, model)
        ids = await prompts.tokenize(
            prompts.chat_prompt_ids, body.messages, model.tokenizer,
            size=sum(len(m.text()) for m in body.messages),
        )
        gen = _generation(ctx, request, body, model, ids, body.requested_max_tokens, "messages")
    except APIError:
        ctx.metrics.requests.labels("rejected").inc()
        raise
    return await _respond(request, body, gen, _ChatFormat(request, model.served_name))


def _size(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return 0


def _precheck(ctx: GatewayContext, body: s.SamplingRequest, model: Any) -> None:
    ctx.check_model(body.model, model)
    problem = body.unsupported()
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _generation(
    ctx: GatewayContext, request: Request, body: s.SamplingRequest, model: Any,
    ids: list[int], max_tokens: int | None, prompt_param: str,
) -> Generation:
    sampling = prompts.sampling_params(
        prompts.Sampling(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, seed=body.seed, ignore_eos=bool(body.ignore_eos),
        ),
        prompt_len=len(ids), max_model_len=model.max_model_len, prompt_param=prompt_param,
    )
    return ctx.generation(
        model, request_id=request.state.request_id, prompt_ids=ids, sampling=sampling,
        slo=prompts.slo(body.slo), stop=body.stop_strings, arrival=request.state.arrival,
    )


async def _respond(request: Request, body: s.SamplingRequest, gen: Generation, fmt: _Format) -> Response:
    deltas = gen.stream()
    try:
        if not body.stream:
            await until_disconnect(request, _drain(deltas))
            return JSONResponse(fmt.response(gen.text, gen).model_dump(mode="json"))
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
        for chunk in fmt.opening(include_usage):
            yield _event(chunk)
        delta = first
        while delta is not None:
            for chunk in fmt.chunks(delta, include_usage):
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


def _event(chunk: str) -> str:
    return f"data: {chunk}\n\n"


def _usage(gen: Generation) -> s.Usage:
    return s.Usage.of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


class _Format:
    """How one API kind renders chunks and the final response."""

    def __init__(self, request: Request, model_name: str, prefix: str) -> None:
        self.id = f"{prefix}-{request.state.request_id}"
        self.model = model_name
        self.created = int(time.time())

    def opening(self, include_usage: bool) -> list[str]:
        return []

    def chunks(self, delta: Delta, include_usage: bool) -> list[str]:
        raise NotImplementedError

    def usage_chunk(self, gen: Generation) -> str:
        raise NotImplementedError

    def response(self, text: str, gen: Generation) -> s.CompletionResponse | s.ChatCompletionResponse:
        raise NotImplementedError

    @staticmethod
    def _dump(chunk: s.CompletionChunk | s.ChatCompletionChunk, include_usage: bool) -> str:
        # OpenAI sends "usage": null on every chunk only when usage was asked for.
        return chunk.model_dump_json(exclude=None if include_usage else {"usage"})


class _CompletionFormat(_Format):
    def __init__(self, request: Request, model_name: str) -> None:
        super().__init__(request, model_name, "cmpl")

    def _chunk(self, choices: list[s.CompletionChoice]) -> s.CompletionChunk:
        return s.CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)

    def chunks(self, delta: Delta, include_usage: bool) -> list[str]:
        choice = s.CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
        return [self._dump(self._chunk([choice]), include_usage)]

    def usage_chunk(self, gen: Generation) -> str:
        chunk = self._chunk([])
        chunk.usage = _usage(gen)
        return chunk.model_dump_json()

    def response(self, text: str, gen: Generation) -> s.CompletionResponse:
        choice = s.CompletionChoice(text=text, finish_reason=gen.finish_reason)
        return s.CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=_usage(gen)
        )


class _ChatFormat(_Format):
    def __init__(self, request: Request, model_name: str) -> None:
        super().__init__(request, model_name, "chatcmpl")

    def _chunk(self, choices: list[s.ChatChunkChoice]) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)

    def opening(self, include_usage: bool) -> list[str]:
        role = s.ChatChunkChoice(delta=s.ChatDelta(role="assistant", content=""))
        return [self._dump(self._chunk([role]), include_usage)]

    def chunks(self, delta: Delta, include_usage: bool) -> list[str]:
        out = []
        if delta.text:
            choice = s.ChatChunkChoice(delta=s.ChatDelta(content=delta.text))
            out.append(self._dump(self._chunk([choice]), include_usage))
        if delta.finish_reason is not None:
            choice = s.ChatChunkChoice(delta=s.ChatDelta(), finish_reason=delta.finish_reason)
            out.append(self._dump(self._chunk([choice]), include_usage))
        return out

    def usage_chunk(self, gen: Generation) -> str:
        chunk = self._chunk([])
        chunk.usage = _usage(gen)
        return chunk.model_dump_json()

    def response(self, text: str, gen: Generation) -> s.ChatCompletionResponse:
        choice = s.ChatChoice(message=s.ChatResponseMessage(content=text), finish_reason=gen.finish_reason)
        return s.ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=_usage(gen)
        )
