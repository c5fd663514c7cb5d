"""The gateway in-process, against a scripted scheduler: the paths a real one rarely takes.

The real-stack tests (test_gateway.py) cover outputs and the common errors; here a tiny
scheduler stub that can refuse (RESOURCE_EXHAUSTED, INVALID_ARGUMENT), die mid-stream (its
token stream fails) or fail lets every scheduler status be checked as the client sees it, quickly, together
with validation, auth, request ids and what the gateway tells the scheduler (sampling,
SLO in seconds, Abort on a stop string). A byte-level tokenizer with no merges keeps
text and ids trivially related.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from gateway.app import create_app, validation_to_api_error
from gateway.context import GatewaySettings
from gateway.conversion import Sampling, sampling_params
from gateway.errors import from_grpc
from proto import scheduler_pb2, scheduler_pb2_grpc

MAX_MODEL_LEN = 64


def _tiny_model_dir(path: Path) -> Path:
    """A byte-level BPE without merges: one token per byte, plus <eos> = 256."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<eos>"])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "chat_template": template}))
    (path / "config.json").write_text("{}")
    return path


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Echoes the prompt back token by token; a leading '!word' picks a failure instead."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.requests: list[scheduler_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.aborts: list[tuple[str, str]] = []
        self.subscriptions: dict[str, asyncio.Queue[scheduler_pb2.TokenBatch | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.text_of: Callable[[list[int]], str] = lambda ids: ""

    async def Subscribe(self, request: Any, context: Any) -> AsyncIterator[scheduler_pb2.TokenBatch]:  # noqa: N802
        queue = self.subscriptions[request.subscriber_id] = asyncio.Queue()
        yield scheduler_pb2.TokenBatch()
        while (batch := await queue.get()) is not None:
            yield batch
        await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler going down")

    async def Submit(self, request: Any, context: Any) -> scheduler_pb2.SubmitReply:  # noqa: N802
        m = request.request
        self.requests.append(m)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        text = self.text_of(list(m.prompt_token_ids))
        if text.startswith("!overload"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        if text.startswith("!invalid"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the scheduler says no")
        queue = self.subscriptions.get(request.subscriber_id)
        if queue is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "subscribe first")
        task = asyncio.create_task(self._play(m, request.stream, text, queue))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return scheduler_pb2.SubmitReply(request_id=m.request_id)

    async def _play(self, request: Any, stream: int, text: str, queue: Any) -> None:
        """Echo the prompt, one batch per token, on the subscription."""
        ids = list(request.prompt_token_ids)
        n = min(len(ids), request.sampling.max_tokens)
        for i in range(n):
            if text.startswith("!die") and i == 2:
                queue.put_nowait(None)  # the whole token stream fails
                return
            if text.startswith("!hang") and i == 1:
                return  # nothing more, ever: only the gateway's --request-timeout ends it
            if text.startswith("!error") and i == 1:
                ev = scheduler_pb2.TokenEvent(request_id=request.request_id, stream=stream,
                                              finish_reason="error")
                queue.put_nowait(scheduler_pb2.TokenBatch(events=[ev]))
                return
            final = i == n - 1
            reason = ("length" if n < len(ids) else "stop") if final else ""
            ev = scheduler_pb2.TokenEvent(request_id=request.request_id, stream=stream,
                                          token_ids=[ids[i]], finish_reason=reason,
                                          output_tokens=i + 1)
            queue.put_nowait(scheduler_pb2.TokenBatch(events=[ev]))
            await asyncio.sleep(0.001)

    async def Abort(self, request: Any, context: Any) -> scheduler_pb2.AbortReply:  # noqa: N802
        self.aborts.append((request.request_id, request.reason))
        return scheduler_pb2.AbortReply(found=True)

    async def GetStats(self, request: Any, context: Any) -> scheduler_pb2.StatsReply:  # noqa: N802
        return scheduler_pb2.StatsReply(
            running=1, device_blocks_total=100, device_blocks_free=75, host_blocks_total=0,
            counters={"rotations": 3.0, "swap_in_blocks": 7.0, "odd-name": 1.0})

    async def GetModelInfo(self, request: Any, context: Any) -> scheduler_pb2.ModelInfo:  # noqa: N802
        return scheduler_pb2.ModelInfo(name="tiny", max_model_len=MAX_MODEL_LEN, vocab_size=257,
                                       source_kind="hf", source_path=str(self.model_dir))


@asynccontextmanager
async def _gateway(tmp_path: Path, *, scheduler: bool = True, **settings: Any
                   ) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedScheduler]]:
    stub = ScriptedScheduler(_tiny_model_dir(tmp_path / "tiny"))
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    if scheduler:
        await server.start()
    app = create_app(GatewaySettings(scheduler_addr=f"127.0.0.1:{port}", grpc_port=0,
                                     rpc_timeout_s=2.0, **settings))
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            if scheduler:
                model = await app.state.ctx.backend.model()
                stub.text_of = model.tokenizer.decode
            yield client, stub
    finally:
        await server.stop(None)


def _run(tmp_path: Path, body: Callable[[httpx.AsyncClient, ScriptedScheduler], Awaitable[None]],
         **kw: Any) -> None:
    async def main() -> None:
        async with _gateway(tmp_path, **kw) as (client, stub):
            await body(client, stub)

    asyncio.run(main())


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def _sse_events(text: str) -> list[Any]:
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


# -- scheduler statuses as the client sees them -----------------------------------------------------


def test_scheduler_refusals_map_to_http_statuses(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.post("/v1/completions", json={"prompt": "!overload now", "stream": True})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert _error(r)["type"] == "rate_limit_error"
        r = await c.post("/v1/completions", json={"prompt": "!invalid x"})
        assert r.status_code == 400 and "the scheduler says no" in _error(r)["message"]
        r = await c.post("/v1/completions", json={"prompt": "!error xyz"})
        assert r.status_code == 500 and _error(r)["code"] == "generation_failed"
        r = await c.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"

    _run(tmp_path, body)


def test_scheduler_dying_mid_stream_ends_the_sse_with_an_error_event(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.post("/v1/completions", json={"prompt": "!die soon", "stream": True})
        assert r.status_code == 200
        events = _sse_events(r.text)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "!d"
        assert events[-1]["error"]["type"] == "service_unavailable"
        r = await c.post("/v1/completions", json={"prompt": "!die soon"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        # The next request opens a new token stream and is served.
        r = await c.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
        assert len(stub.subscriptions) == 3

    _run(tmp_path, body)


def test_request_timeout_is_a_504_and_frees_the_request(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.post("/v1/completions", headers={"X-Request-ID": "slow-1"},
                         json={"prompt": "!hang on"})
        assert r.status_code == 504 and _error(r)["code"] == "scheduler_timeout"
        for _ in range(100):  # the Abort is sent in the background
            if ("slow-1", "abort") in stub.aborts:
                break
            await asyncio.sleep(0.01)
        assert ("slow-1", "abort") in stub.aborts
        r = await c.post("/v1/completions", json={"prompt": "fast"})  # the stream lives on
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fast"

    _run(tmp_path, body, request_timeout_s=0.3)


def test_no_scheduler_means_503_everywhere_but_metrics(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert _error(r)["type"] == "service_unavailable"
        for path, req in [("/v1/completions", {"prompt": "x"}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
            r = await c.post(path, json=req)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert (await c.get("/v1/models")).status_code == 503
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
        assert r.status_code == 400  # validation needs no scheduler
        r = await c.get("/metrics")
        assert r.status_code == 200 and "superinfer_scheduler_up 0.0" in r.text
        assert "vllm:" not in r.text  # no model name to label them with yet
        r = await c.get("/livez")  # the supervisor's liveness check: the gateway itself runs
        assert r.status_code == 200 and r.json() == {"status": "alive"}

    _run(tmp_path, body, scheduler=False)


# -- what the gateway sends --------------------------------------------------------------------------


def test_request_fields_reach_the_scheduler(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.post("/v1/completions", headers={"X-Request-ID": "abc.DEF_1-2"}, json={
            "model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0.5,
            "top_p": 0.9, "top_k": 7, "seed": 42, "ignore_eos": True,
            "slo": {"ttft_ms": 1500, "tbt_ms": 50}})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc.DEF_1-2"
        assert r.json()["id"] == "cmpl-abc.DEF_1-2"
        assert r.json()["choices"][0] == {"index": 0, "text": "hello", "logprobs": None,
                                          "finish_reason": "length"}
        req = stub.requests[-1]
        assert req.request_id == "abc.DEF_1-2" and stub.metadata[-1]["x-request-id"] == "abc.DEF_1-2"
        s = req.sampling
        assert (s.max_tokens, s.top_k, s.seed, s.ignore_eos) == (5, 7, 42, True)
        assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
        assert (req.slo.ttft_s, req.slo.tbt_s) == (1.5, 0.05)

        # OpenAI defaults; max_tokens fills the context.
        r = await c.post("/v1/completions", json={"prompt": "abc"})
        s = stub.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (1.0, 1.0, 0, MAX_MODEL_LEN - 3)
        assert not s.HasField("seed")
        r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": MAX_MODEL_LEN - 2})
        assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"

    _run(tmp_path, body)


def test_chat_uses_the_template_and_max_completion_tokens(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3, "max_completion_tokens": 27})
        assert r.status_code == 200
        out = r.json()
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-req-")
        # The echo stub returns the rendered prompt (cut at max_tokens): the template was applied.
        rendered = "[system]be brief\n[user]hi\n[assistant]"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": rendered[:27]}
        assert stub.requests[-1].sampling.max_tokens == 27
        assert out["usage"]["prompt_tokens"] == len(rendered)

    _run(tmp_path, body)


def test_stop_string_is_held_back_and_aborts_with_reason_stop(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.post("/v1/completions", headers={"X-Request-ID": "s1"}, json={
            "prompt": "abc STOP def", "stop": "STOP", "stream": True,
            "stream_options": {"include_usage": True}})
        events = _sse_events(r.text)
        texts = [e["choices"][0]["text"] for e in events if e["choices"]]
        assert "".join(texts) == "abc " and not any("S" in t for t in texts)
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
        for _ in range(100):  # the Abort is sent in the background
            if ("s1", "stop") in stub.aborts:
                break
            await asyncio.sleep(0.01)
        assert ("s1", "stop") in stub.aborts

    _run(tmp_path, body)


# -- validation, ids, auth, metrics ------------------------------------------------------------------


def test_validation_errors_name_the_field(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        cases = [
            ({"prompt": "x", "top_k": -2}, "top_k"),
            ({"prompt": "x", "seed": 2**64}, "seed"),
            ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
            ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
            ({"prompt": "x", "suffix": "y"}, "suffix"),
            ({"prompt": "x", "slo": {"ttft_ms": -1}}, "slo.ttft_ms"),
            ({"prompt": "x", "stream": "yes"}, "stream"),
            ({"prompt": [[1, 2], [3]]}, "prompt"),
            ({"prompt": 5}, "prompt"),
        ]
        for req, param in cases:
            r = await c.post("/v1/completions", json=req)
            assert r.status_code == 400, (req, r.text)
            assert _error(r)["param"] == param, (req, r.text)
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]})
        assert r.status_code == 400 and _error(r)["param"] == "messages[0].content"
        r = await c.post("/v1/completions", json={"prompt": "y" * 20_000})  # tokenized off-loop
        assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", content=b"{}", headers={
            "content-type": "application/json", "content-length": str(1 << 30)})
        assert r.status_code == 413 and _error(r)["code"] == "body_too_large"
        r = await c.post("/v1/completions", json={"prompt": "x", "frequency_penalty": 0,
                                                  "user": "u", "unknown_field": 1})
        assert r.status_code == 200  # no-op values and unknown fields are fine

    _run(tmp_path, body)


def test_request_ids_are_validated_or_made(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        for bad in ("x" * 129, "has space", "semi;colon", ""):
            r = await c.get("/health", headers={"X-Request-ID": bad})
            assert r.status_code == 400 and _error(r)["param"] == "X-Request-ID"
        r = await c.get("/health", headers={"X-Request-ID": "x" * 128})
        assert r.status_code == 200 and r.headers["x-request-id"] == "x" * 128
        made = (await c.get("/health")).headers["x-request-id"]
        assert made.startswith("req-") and len(made) == 36

    _run(tmp_path, body)


def test_api_key_guards_v1_only(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = await c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
        r = await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "served-name"
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200

    _run(tmp_path, body, api_key="sekrit", served_model_name="served-name")


def test_in_flight_and_body_size_are_bounded(tmp_path: Path) -> None:
    """Slots are taken before the body is read, so slow uploads count; chunked bodies too."""
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        go = asyncio.Event()

        async def slow_body() -> AsyncIterator[bytes]:
            await go.wait()
            yield json.dumps({"prompt": "held", "max_tokens": 2}).encode()

        held = [asyncio.create_task(c.post("/v1/completions", content=slow_body(),
                                           headers={"content-type": "application/json"}))
                for _ in range(2)]
        await asyncio.sleep(0.2)
        for path, req in (("/v1/completions", {"prompt": "x"}), ("/v1/models", None)):
            r = await (c.post(path, json=req) if req else c.get(path))
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert _error(r)["code"] == "overloaded" and "--max-in-flight" in _error(r)["message"]
        assert (await c.get("/health")).status_code == 200  # probes are not counted
        go.set()
        assert [(await t).status_code for t in held] == [200, 200]
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200

        async def chunked(n: int, size: int) -> AsyncIterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(n):
                yield b"y" * size
            yield b'"}'

        json_type = {"content-type": "application/json"}
        r = await c.post("/v1/completions", content=chunked(20, 100), headers=json_type)
        assert r.status_code == 413 and _error(r)["code"] == "body_too_large"  # no Content-Length
        assert "--max-body-bytes" in _error(r)["message"]
        r = await c.post("/v1/completions", json={"prompt": "z" * 2000})
        assert r.status_code == 413
        r = await c.post("/v1/completions", content=chunked(3, 5), headers=json_type)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "y" * 15
        r = await c.post("/v1/completions", json={"prompt": "x", "stop": ["s" * 257]})
        assert r.status_code == 400 and _error(r)["param"] == "stop"
        assert app_in_flight(c) == 0

    _run(tmp_path, body, max_in_flight=2, max_body_bytes=1000)


def app_in_flight(c: httpx.AsyncClient) -> int:
    transport = c._transport
    assert isinstance(transport, httpx.ASGITransport)
    return int(transport.app.state.ctx.in_flight.count)  # type: ignore[attr-defined]


def test_metrics_mirror_scheduler_stats(tmp_path: Path) -> None:
    async def body(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        await c.post("/v1/completions", json={"prompt": "hello"})
        await c.post("/v1/completions", json={"prompt": "x", "n": 33})  # rejected
        text = (await c.get("/metrics")).text
        vllm = 'engine="0",model_name="tiny"'
        for line in [
            'superinfer_requests_total{status="stop"} 1.0',
            'superinfer_requests_total{status="rejected"} 1.0',
            "superinfer_generation_tokens_total 5.0",
            "superinfer_prompt_tokens_total 5.0",
            "superinfer_requests_running 1.0",
            'superinfer_kv_blocks_free{tier="device"} 75.0',
            'superinfer_kv_usage_ratio{tier="device"} 0.25',
            'superinfer_kv_usage_ratio{tier="host"} 0.0',
            "# TYPE superinfer_scheduler_rotations_total counter",
            "superinfer_scheduler_rotations_total 3.0",
            "superinfer_scheduler_swap_in_blocks_total 7.0",
            # A statistic this gateway has no entry for is passed on, untyped.
            "# TYPE superinfer_scheduler_odd_name untyped",
            "superinfer_scheduler_odd_name 1.0",
            "superinfer_time_to_first_token_seconds_count 1.0",
            "superinfer_inter_token_latency_seconds_count 4.0",
            # The same quantities under vLLM's names, labelled with the served model.
            f"vllm:num_requests_running{{{vllm}}} 1.0",
            f"vllm:kv_cache_usage_perc{{{vllm}}} 0.25",
            f"vllm:generation_tokens_total{{{vllm}}} 5.0",
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0',
            f"vllm:inter_token_latency_seconds_count{{{vllm}}} 4.0",
        ]:
            assert line in text, line

    _run(tmp_path, body)


# -- pure functions ----------------------------------------------------------------------------------


def test_grpc_status_mapping() -> None:
    def err(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="d")

    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: (400, None),
        grpc.StatusCode.NOT_FOUND: (404, None),
        grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "1"),
        grpc.StatusCode.UNAVAILABLE: (503, "1"),
        grpc.StatusCode.INTERNAL: (500, None),
    }
    for code, (status, retry) in cases.items():
        e = from_grpc(err(code))
        assert e.status == status and e.headers.get("Retry-After") == retry
        assert "d" in e.message
    # The scheduler's retry pushback (ms) becomes whole seconds, and goes on to gRPC clients.
    pushback = grpc.aio.Metadata(("grpc-retry-pushback-ms", "2500"))
    e = from_grpc(grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                       pushback, details="full"))
    assert e.headers["Retry-After"] == "3"
    assert e.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.grpc_trailers == (("grpc-retry-pushback-ms", "3000"),)


def test_validation_error_paths() -> None:
    e = validation_to_api_error([{"loc": ("body", "messages", 2, "content"), "msg": "bad",
                                  "type": "value_error"}])
    assert (e.status, e.param, e.message) == (400, "messages[2].content", "messages[2].content: bad")
    e = validation_to_api_error([{"loc": ("body", 17), "msg": "JSON decode error",
                                  "type": "json_invalid", "ctx": {"error": "Expecting value"}}])
    assert e.param is None and "not valid JSON" in e.message


def test_sampling_defaults_and_limits() -> None:
    p = sampling_params(Sampling(), prompt_len=10, max_model_len=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (90, 1.0, 1.0, 0)
    p = sampling_params(Sampling(top_k=-1, seed=-3), prompt_len=10, max_model_len=100)
    assert p.top_k == 0 and p.seed == -3
    for bad in (Sampling(max_tokens=91), Sampling(temperature=-0.1), Sampling(top_p=0.0)):
        with pytest.raises(Exception) as e:
            sampling_params(bad, prompt_len=10, max_model_len=100)
        assert getattr(e.value, "status", None) == 400
    with pytest.raises(Exception) as e:
        sampling_params(Sampling(), prompt_len=100, max_model_len=100)
    assert getattr(e.value, "code", None) == "context_length_exceeded"


def test_unset_sampling_fields_take_the_models_generation_config(tmp_path: Path) -> None:
    """As vLLM's --generation-config auto: the model's generation_config.json fills the
    fields a request leaves unset, and only those; `vllm` keeps OpenAI's; /v1/models says
    which are in force."""
    model_dir = _tiny_model_dir(tmp_path / "tiny")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1,
         "eos_token_id": 256}))

    async def auto(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        r = await c.get("/v1/models")
        d = r.json()["data"][0]["generation_defaults"]
        assert (d["temperature"], d["top_p"], d["top_k"]) == (0.3, 0.8, 20)
        assert d["source"].endswith("generation_config.json")
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        s = stub.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k) == pytest.approx((0.3, 0.8, 20))
        assert s.repetition_penalty == pytest.approx(1.1)
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "temperature": 0.9,
                                              "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0})
        s = stub.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == pytest.approx(
            (0.9, 1.0, 0, 1.0))

    async def vllm(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        s = stub.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (1.0, 1.0, 0, 1.0)

    _run(tmp_path, auto)
    _run(tmp_path, vllm, generation_config="vllm")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))

    async def mine(c: httpx.AsyncClient, stub: ScriptedScheduler) -> None:
        await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert stub.requests[-1].sampling.temperature == 0.0
        assert stub.requests[-1].sampling.top_p == 1.0  # not in that file: OpenAI's

    _run(tmp_path, mine, generation_config=str(folder))
    with pytest.raises(ValueError, match="generation_config.json"):
        GatewaySettings(generation_config=str(tmp_path / "nowhere"))
