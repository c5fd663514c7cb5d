"""The gateway end to end: real worker + kvmem + scheduler + gateway processes.

Everything a client would notice is checked with the official `openai` client (or raw
HTTP where the client hides the detail): text equal to the in-process engine's greedy
output, streaming, stop strings, seeds, usage, error bodies and statuses, freed KV
blocks after 32 concurrent clients and after a client that hangs up, metrics, and the
X-Request-ID travelling into the gateway's and the scheduler's logs.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import client_pb2, client_pb2_grpc, common_pb2
from tests.stack import CHAT_PROMPTS, DEVICE_BLOCKS, MAX_TOKENS, PLAIN_PROMPTS, Stack


# The session's shared stack (tests/stack.py): its reference holds this module's greedy
# outputs under "plain" and "chat".
@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The session's stack (tests/stack.py, conftest.py)."""
    return shared_stack


def _error(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return dict(body["error"])


def _wait_all_blocks_free(stack: Stack, timeout_s: float = 15.0) -> dict[Any, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = stack.metrics()
        free = m[("superinfer_kv_blocks_free", (("tier", "device"),))]
        total = m[("superinfer_kv_blocks_capacity", (("tier", "device"),))]
        busy = m[("superinfer_requests_running", ())] + m[("superinfer_requests_waiting", ())]
        if free == total and busy == 0:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"device blocks not all free after {timeout_s} s: {free}/{total}, "
                        f"{busy} requests still live")
        time.sleep(0.1)


# -- outputs ------------------------------------------------------------------------------------


def test_models_and_health(stack: Stack) -> None:
    models = stack.client().models.list()
    assert [m.id for m in models.data] == [stack.model]
    with stack.http() as h:
        r = h.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_greedy_equals_engine(stack: Stack) -> None:
    ref = stack.reference["plain"][0]
    r = stack.client().completions.create(
        model=stack.model, prompt=PLAIN_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == stack.model
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        ref["prompt_tokens"], len(ref["token_ids"]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_prompt_as_token_ids_or_a_list_of_one_string(stack: Stack) -> None:
    ref = stack.reference["plain"][1]
    client = stack.client()
    for prompt in (ref["prompt_ids"], [ref["prompt_ids"]], [PLAIN_PROMPTS[1]]):
        r = client.completions.create(model=stack.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
        assert r.choices[0].text == ref["text"]
        assert r.usage is not None and r.usage.prompt_tokens == ref["prompt_tokens"]


def test_chat_greedy_equals_engine_streaming_and_not(stack: Stack) -> None:
    client = stack.client()
    for i, prompt in enumerate(CHAT_PROMPTS):
        ref = stack.reference["chat"][i]
        messages = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(model=stack.model, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
        assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref["text"]
        assert r.choices[0].finish_reason == ref["finish_reason"]
        assert r.usage is not None and r.usage.prompt_tokens == ref["prompt_tokens"]

        chunks = list(client.chat.completions.create(
            model=stack.model, messages=messages, max_completion_tokens=MAX_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref["text"]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == ref["finish_reason"] and not any(finishes[:-1])
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == len(ref["token_ids"])
        assert all(c.usage is None for c in chunks[:-1])


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(stack: Stack) -> None:
    """The same long conversation twice: the second finds its prompt's full blocks cached
    (prefix caching is on by default), says so in usage, and answers the same."""
    client = stack.client()
    messages = [{"role": "system", "content": "You are a patient tutor. " * 12},
                {"role": "user", "content": "Explain why the sky is blue, briefly."}]
    first = client.chat.completions.create(model=stack.model, messages=messages,
                                           max_tokens=8, temperature=0)
    second = client.chat.completions.create(model=stack.model, messages=messages,
                                            max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert first.usage is not None and second.usage is not None
    n = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert n > 64 and n - 16 <= cached < n and cached % 16 == 0  # all full blocks but the last
    assert first.usage.prompt_tokens_details.cached_tokens < cached  # type: ignore[union-attr]
    streamed = chunks[-1].usage
    assert streamed is not None and streamed.prompt_tokens_details.cached_tokens == cached  # type: ignore[union-attr]
    assert second.choices[0].message.content == first.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content


def test_chat_content_parts_and_system_role(stack: Stack) -> None:
    client = stack.client()
    ref = stack.reference["chat"][0]
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    r = client.chat.completions.create(model=stack.model, temperature=0, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": parts}])
    assert r.choices[0].message.content == ref["text"]
    r = client.chat.completions.create(model=stack.model, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"}])
    assert r.usage is not None and r.usage.completion_tokens <= 4


def test_streaming_completion_matches_and_reports_usage(stack: Stack) -> None:
    ref = stack.reference["plain"][2]
    chunks = list(stack.client().completions.create(
        model=stack.model, prompt=PLAIN_PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref["finish_reason"]


def test_raw_sse_framing(stack: Stack) -> None:
    with stack.http() as h, h.stream("POST", "/v1/completions", json={
        "prompt": PLAIN_PROMPTS[0], "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        assert json.loads(e[len("data: "):])["object"] == "text_completion"


def test_stop_strings_cut_the_text_and_free_the_request(stack: Stack) -> None:
    ref_text = stack.reference["plain"][1]["text"]
    # A stop string from the middle of the known greedy output.
    pos = next(i for i in range(len(ref_text) // 3, len(ref_text))
               if ref_text[i] == " " and ref_text.find(ref_text[i:i + 4]) == i)
    stop = ref_text[pos:pos + 4]
    client = stack.client()
    r = client.completions.create(model=stack.model, prompt=PLAIN_PROMPTS[1], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=[stop, "never-appears"])
    assert r.choices[0].text == ref_text[:pos]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=stack.model, prompt=PLAIN_PROMPTS[1],
                                            max_tokens=MAX_TOKENS, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref_text[:pos]
    assert chunks[-1].choices[0].finish_reason == "stop"
    _wait_all_blocks_free(stack)


def test_max_tokens_and_ignore_eos(stack: Stack) -> None:
    client = stack.client()
    r = client.completions.create(model=stack.model, prompt=PLAIN_PROMPTS[0], max_tokens=5,
                                  temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    assert stack.reference["plain"][0]["text"].startswith(r.choices[0].text)
    r = client.chat.completions.create(model=stack.model, max_tokens=40, temperature=0,
                                       messages=[{"role": "user", "content": "Say OK."}],
                                       extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 40


def test_same_seed_same_text(stack: Stack) -> None:
    client = stack.client()

    def sample(seed: int) -> str:
        r = client.completions.create(model=stack.model, prompt=PLAIN_PROMPTS[4], max_tokens=16,
                                      temperature=0.8, seed=seed)
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1  # it really samples


def test_slo_extra_is_accepted(stack: Stack) -> None:
    r = stack.client().completions.create(model=stack.model, prompt=PLAIN_PROMPTS[0], max_tokens=2,
                                          extra_body={"slo": {"ttft_ms": 2000, "tbt_ms": 250}})
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_32_concurrent_streams_are_correct_and_free_every_block(stack: Stack) -> None:
    client = stack.async_client()

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=stack.model, prompt=PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)], max_tokens=MAX_TOKENS,
            temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    def finished(m: dict[Any, float]) -> float:
        return sum(m[("superinfer_requests_total", (("status", s),))] for s in ("length", "stop"))

    before = finished(stack.metrics())
    t0 = time.monotonic()
    texts = asyncio.run(main())
    elapsed = time.monotonic() - t0
    expected = [stack.reference["plain"][i % len(PLAIN_PROMPTS)]["text"] for i in range(32)]
    assert texts == expected
    m = _wait_all_blocks_free(stack)
    assert finished(m) == before + 32
    print(f"32 concurrent streams x {MAX_TOKENS} tokens: {elapsed:.1f} s")


def test_client_disconnect_frees_blocks(stack: Stack) -> None:
    rid = "disconnect-test-1"
    with stack.http() as h, h.stream("POST", "/v1/completions", headers={"X-Request-ID": rid}, json={
        "prompt": PLAIN_PROMPTS[1], "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
        "stream": True,
    }) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    t0 = time.monotonic()
    _wait_all_blocks_free(stack, timeout_s=10)
    assert time.monotonic() - t0 < 10  # 4000 tokens would take minutes: it was aborted
    log = (stack.run_dir / "gateway.log").read_text()
    lines = [json.loads(x) for x in log.splitlines() if rid in x]
    assert any(x["event"] == "request finished" and x["outcome"] == "abort" for x in lines)


def test_non_streaming_disconnect_frees_blocks(stack: Stack) -> None:
    with stack.http() as h, pytest.raises(httpx.ReadTimeout):
        h.post("/v1/completions", timeout=1.5, json={
            "prompt": PLAIN_PROMPTS[0], "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
    _wait_all_blocks_free(stack, timeout_s=10)


# -- errors ---------------------------------------------------------------------------------------

LONG = list(range(100, 100 + 9000))  # more token ids than the 8192-token context

BAD_REQUESTS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (path, what, body (bytes: raw), status, param, code)
    ("/v1/completions", "malformed json", b'{"prompt": "x",', 400, None, "invalid_json"),
    ("/v1/completions", "body not an object", [1, 2], 400, None, None),
    ("/v1/completions", "missing prompt", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/chat/completions", "missing messages", {"model": "x"}, 400, "messages", None),
    ("/v1/completions", "wrong type", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("/v1/completions", "temperature type", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", "zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", "negative max_tokens", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", None),
    ("/v1/completions", "huge max_tokens", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", "overflowing max_tokens", {"prompt": "x", "max_tokens": 10**30}, 400,
     "max_tokens", None),
    ("/v1/completions", "prompt over context", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", "token id out of range", {"prompt": [1, 10**8]}, 400, "prompt", None),
    ("/v1/completions", "empty prompt", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", "batched prompts", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", "n=33", {"prompt": "x", "n": 33}, 400, "n", None),
    ("/v1/completions", "negative temperature", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", "top_p zero", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", "stop not strings", {"prompt": "x", "stop": [1]}, 400, "stop", None),
    ("/v1/completions", "stream_options without stream", {"prompt": "x", "stream_options": {
        "include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", "logprobs=21", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", "unknown model", {"prompt": "x", "model": "gpt-17"}, 404, "model",
     "model_not_found"),
    ("/v1/chat/completions", "empty messages", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", "bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("/v1/chat/completions", "image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", "n=0", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", None),
    ("/v1/chat/completions", "negative max_completion_tokens", {
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens", None),
]


@pytest.mark.parametrize(("path", "what", "body", "status", "param", "code"), BAD_REQUESTS,
                         ids=[b[1] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(stack: Stack, path: str, what: str, body: Any, status: int,
                                       param: str | None, code: str | None) -> None:
    with stack.http() as h:
        if isinstance(body, bytes):
            r = h.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = h.post(path, json=body)
    assert r.status_code == status, r.text
    err = _error(r)
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if status == 400:
        assert err["type"] == "invalid_request_error"
    assert r.headers["x-request-id"]


def test_errors_through_the_openai_client_and_server_still_serves(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack.model, prompt="x", n=2, best_of=1)
    assert "best_of" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with stack.http() as h:
        r = h.get("/v1/no-such-route")
        assert r.status_code == 404 and _error(r)["code"] == "not_found"
        r = h.get("/v1/completions")
        assert r.status_code == 405 and _error(r)
        r = h.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-ID": "bad id!"})
        assert r.status_code == 400 and _error(r)["param"] == "X-Request-ID"
    r2 = client.completions.create(model=stack.model, prompt=PLAIN_PROMPTS[0], max_tokens=3,
                                   temperature=0)
    assert r2.choices[0].text == stack.reference["plain"][0]["text"][: len(r2.choices[0].text)]
    with stack.http() as h:
        assert h.get("/health").status_code == 200


def test_duplicate_in_flight_request_id_is_rejected(stack: Stack) -> None:
    rid = "dup-id-1"
    with stack.http() as h, h.stream("POST", "/v1/completions", headers={"X-Request-ID": rid}, json={
        "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)
        with stack.http() as h2:
            r2 = h2.post("/v1/completions", headers={"X-Request-ID": rid},
                         json={"prompt": "y", "max_tokens": 1})
        assert r2.status_code == 409 and _error(r2)["code"] == "duplicate_request_id"
    _wait_all_blocks_free(stack)


# -- observability ----------------------------------------------------------------------------------


def test_metrics_expose_the_listed_series(stack: Stack) -> None:
    stack.client().completions.create(model=stack.model, prompt="x", max_tokens=2)
    with stack.http() as h:
        r = h.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {s.name for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    for name in [
        "superinfer_requests_total", "superinfer_prompt_tokens_total",
        "superinfer_generation_tokens_total", "superinfer_time_to_first_token_seconds_bucket",
        "superinfer_inter_token_latency_seconds_bucket", "superinfer_e2e_request_latency_seconds_bucket",
        "superinfer_requests_running", "superinfer_requests_waiting", "superinfer_requests_rotary",
        "superinfer_kv_blocks_capacity", "superinfer_kv_blocks_free", "superinfer_kv_usage_ratio",
        "superinfer_scheduler_rotations_total", "superinfer_scheduler_swap_in_blocks_total",
        "superinfer_scheduler_swap_out_blocks_total", "superinfer_scheduler_eager_blocks_total",
        "superinfer_scheduler_recomputes_total", "superinfer_scheduler_preemptions_total",
    ]:
        assert name in names, name
    m = stack.metrics()
    assert m[("superinfer_kv_blocks_capacity", (("tier", "device"),))] == DEVICE_BLOCKS
    assert m[("superinfer_kv_blocks_capacity", (("tier", "host"),))] > 0
    for status in ("stop", "length", "abort", "rejected", "error"):
        assert ("superinfer_requests_total", (("status", status),)) in m
    assert m[("superinfer_time_to_first_token_seconds_count", ())] > 0


def test_request_id_is_echoed_and_logged_by_gateway_and_scheduler(stack: Stack) -> None:
    rid = "trace-me-123"
    with stack.http() as h:
        r = h.post("/v1/completions", headers={"X-Request-ID": rid},
                   json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        generated = h.get("/health").headers["x-request-id"]
    assert generated.startswith("req-") and len(generated) == 36
    gateway_lines = [json.loads(x) for x in (stack.run_dir / "gateway.log").read_text().splitlines()
                     if rid in x]
    assert gateway_lines and all(x["request_id"] == rid for x in gateway_lines)
    assert all(x["service"] == "gateway" for x in gateway_lines)
    deadline = time.monotonic() + 5
    while rid not in (stack.run_dir / "scheduler.log").read_text():
        assert time.monotonic() < deadline, "request id missing from scheduler.log"
        time.sleep(0.1)


# -- client gRPC API -----------------------------------------------------------------------------


def test_grpc_generate_abort_and_errors(stack: Stack) -> None:
    ref = stack.reference["plain"][0]

    async def main() -> None:
        async with grpc.aio.insecure_channel(stack.grpc_addr,
                                             options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = client_pb2_grpc.SuperInferStub(ch)
            greedy = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            events = [e async for e in stub.Generate(client_pb2.ClientGenerateRequest(
                prompt=PLAIN_PROMPTS[0], sampling=greedy))]
            assert "".join(e.text for e in events) == ref["text"]
            assert [t for e in events for t in e.token_ids] == ref["token_ids"]
            assert events[-1].finish_reason == ref["finish_reason"]
            assert events[-1].completion_tokens == len(ref["token_ids"])

            call = stub.Generate(client_pb2.ClientGenerateRequest(
                request_id="grpc-abort-1", prompt="Tell me a story",
                sampling=common_pb2.SamplingParams(max_tokens=4000, ignore_eos=True)))
            last = None
            async for e in call:
                if last is None:
                    reply = await stub.Abort(client_pb2.ClientAbortRequest(request_id="grpc-abort-1"))
                    assert reply.found
                last = e
            assert last is not None and last.finish_reason == "abort"
            assert not (await stub.Abort(client_pb2.ClientAbortRequest(request_id="nope"))).found

            for bad, code in [
                (client_pb2.ClientGenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
                (client_pb2.ClientGenerateRequest(prompt="x", model="gpt-17"), grpc.StatusCode.NOT_FOUND),
                (client_pb2.ClientGenerateRequest(prompt_token_ids=LONG), grpc.StatusCode.INVALID_ARGUMENT),
                (client_pb2.ClientGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                    top_p=2.0)), grpc.StatusCode.INVALID_ARGUMENT),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [e async for e in stub.Generate(bad)]
                assert err.value.code() == code, err.value.details()

            from grpc_health.v1 import health_pb2, health_pb2_grpc

            status = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(main())
    _wait_all_blocks_free(stack)


def test_scheduler_trace_has_iterations_transfers_and_request_states(stack: Stack) -> None:
    """`--trace`: one span per iteration on the schedule / execute tracks, load counters, and
    each finished request's states on its own async track (Perfetto / chrome://tracing)."""
    from scheduler_svc.trace import load_trace

    with stack.http() as h:
        r = h.post("/v1/completions", json={"model": stack.model, "prompt": "Trace me",
                                            "max_tokens": 5, "ignore_eos": True},
                   headers={"X-Request-ID": "traced-1"})
        assert r.status_code == 200
    path = stack.run_dir / "scheduler.trace.json"
    deadline = time.monotonic() + 10
    while True:  # the trace is flushed at least once a second
        events = load_trace(path)
        mine = [e for e in events if e.get("id") == "traced-1"]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    names = {(e["ph"], e.get("name")) for e in mine}
    assert ("b", "waiting") in names and ("b", "running") in names, names
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {e["tid"] for e in spans}
    assert {1, 4} <= tracks  # schedule, execute
    iters = [e for e in spans if e["tid"] == 1]
    assert iters and all(e["dur"] >= 0 and "chunks" in e["args"] for e in iters)
    assert any(e["ph"] == "C" and "running" in e["args"] for e in events)


def test_kvmem_runs_with_the_non_temporal_copy_threshold(stack: Stack) -> None:
    from kvmem_svc.tunables import NT_THRESHOLD, applies_here

    if not applies_here():
        pytest.skip("glibc tunables apply to x86-64 Linux only")
    lines = [json.loads(line) for line in (stack.run_dir / "kvmem.log").read_text().splitlines()
             if '"copy_tunables"' in line]
    assert lines and lines[-1]["nt_threshold"] == NT_THRESHOLD


def test_the_benchmarks_lean_client_reads_what_httpx_reads(stack: Stack) -> None:
    """The overhead and pipeline studies stream with experiments/sse_client.py (least CPU
    taken from the server beside it): the same token counts and first tokens as httpx, and
    a refused request fails with the gateway's status."""
    from experiments.overhead import _served_once
    from experiments.sse_client import stream_post

    prompts = PLAIN_PROMPTS[:3]
    lean = asyncio.run(_served_once(stack.http_url, prompts, 7, "lean"))
    plain = asyncio.run(_served_once(stack.http_url, prompts, 7, "httpx"))
    assert lean.new_tokens == plain.new_tokens == 3 * 7
    assert 0 < lean.mean_ttft_s <= lean.wall_s
    with pytest.raises(RuntimeError, match="gateway answered 400"):
        asyncio.run(stream_post(stack.http_url, "/v1/completions",
                                {"prompt": "x", "max_tokens": -1, "stream": True}))
    _wait_all_blocks_free(stack)
