"""What an inference router asks a replica besides the OpenAI API (docs/routers.md).

vllm-router's `kv_aware` policy keeps no tokenizer of its own for HTTP workers: for each
request and each replica it POSTs the request's body to the replica's render route
(`/v1/completions/render`, `/v1/chat/completions/render`) and reads `token_ids`, falling
back to vLLM's `POST /tokenize` where render answers 404. It matches those ids against
the blocks the replica's KV events reported, so they must be exactly the ids the engine
will compute: render runs the very conversion a generation request goes through
(gateway/conversion.py: the chat template, tools, checks). With dynamic discovery it also
reads `GET /get_server_info` (model, instance id, block size) and `GET /kv_event_sources`
(where the scheduler publishes, `--kv-events-config`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway import conversion
from gateway import openai_schema as s
from gateway.backend import ModelState
from gateway.context import GatewayContext
from gateway.errors import APIError, invalid

router = APIRouter()


def _ctx(request: Request) -> GatewayContext:
    ctx: GatewayContext = request.app.state.ctx
    return ctx


@router.post("/v1/completions/render")
async def render_completion(body: s.CompletionRequest, request: Request) -> JSONResponse:
    model = await _ctx(request).backend.model()
    req = await conversion.from_completion(body, model)
    return JSONResponse({"token_ids": req.prompt_ids})


@router.post("/v1/chat/completions/render")
async def render_chat(body: s.ChatCompletionRequest, request: Request) -> JSONResponse:
    model = await _ctx(request).backend.model()
    req = await conversion.from_chat(body, model)
    return JSONResponse({"token_ids": req.prompt_ids})


@router.post("/tokenize")
async def tokenize(body: dict[str, Any], request: Request) -> JSONResponse:
    """vLLM's /tokenize: `{prompt}` or `{messages}` (the chat template applied, the
    generation prompt added) -> `{tokens, count, max_model_len}`; the ids a completion or
    chat completion of that prompt computes."""
    model = await _ctx(request).backend.model()
    conversion.check_model(body.get("model"), model)
    ids = await _tokenize(body, model)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len})


async def _tokenize(body: dict[str, Any], model: ModelState) -> list[int]:
    for field, default in (("add_generation_prompt", True), ("continue_final_message", False),
                           ("chat_template", None), ("chat_template_kwargs", None)):
        if body.get(field, default) not in (default, None):
            raise APIError(400, f"{field} is not supported: SuperInfer renders chats with the "
                           "model's own template and the generation prompt",
                           param=field, code="unsupported_parameter")
    if "messages" in body:
        chat = s.ChatCompletionRequest.model_validate({"messages": body["messages"]})
        return await conversion.tokenize(conversion.chat_prompt_ids, chat.messages,
                                         model.tokenizer,
                                         size=sum(len(m.text()) for m in chat.messages))
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("give prompt or messages", param="prompt")
    return await conversion.tokenize(conversion.completion_prompt_ids, prompt, model.tokenizer,
                                     model.vocab_size,
                                     size=len(prompt) if isinstance(prompt, str) else 0)


@router.get("/get_server_info")
async def server_info(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    model = await ctx.backend.model()
    return JSONResponse({"model_id": model.served_name, "instance_id": ctx.settings.replica_id,
                         "kv_block_size": model.info.block_size,
                         "max_model_len": model.max_model_len})


@router.get("/kv_event_sources")
async def kv_event_sources(request: Request) -> JSONResponse:
    """vLLM's shape, keyed by data-parallel rank (one here); {} when events are off."""
    info = (await _ctx(request).backend.model()).info
    if not info.kv_events_endpoint:
        return JSONResponse({})
    entry: dict[str, Any] = {
        "endpoint": info.kv_events_endpoint, "topic": info.kv_events_topic,
        "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
        "enable_kv_cache_events": True,
    }
    if info.kv_events_replay_endpoint:
        entry["replay_endpoint"] = info.kv_events_replay_endpoint
    return JSONResponse({"0": entry})
