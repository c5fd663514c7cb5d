"""Admission control, size limits and security, against real worker/kvmem/scheduler/gateway.

One stack for the module, started the way an operator would harden it: the scheduler
admits at most ``LIMIT`` live requests, the gateway takes its API key from the
environment (so the key is not on any command line) and refuses bodies over
``MAX_BODY``. Everything a client or an attacker would notice is checked: 429 with
Retry-After and RESOURCE_EXHAUSTED with gRPC's retry pushback past the limit, clear 4xx
for oversized input, 401 for a missing or wrong key on both front doors, no port
listening beyond loopback, an owner-only shared-memory pool with an unguessable name, a
schemathesis fuzz of the OpenAPI schema with no 5xx, and hundreds of clients hanging up
mid-stream leaving every block free and the processes' memory where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import random
import re
import socket
import stat
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.daemon import free_port
from proto import client_pb2, client_pb2_grpc, common_pb2
from superinfer.probes import grpc_probe, http_probe
from superinfer.supervisor import ServiceSpec, Supervisor
from tests.stack import CHILD_ENV, STARTUP_TIMEOUT_S
from tests.stack import environment as _environment

LIMIT = 16  # --max-queued-requests
MAX_BODY = 64 << 10  # --max-body-bytes
MAX_MODEL_LEN = 256
API_KEY = "test-key-" + os.urandom(8).hex()
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def add(a, b):"]
SERVICES = ("worker", "kvmem", "scheduler", "gateway")
# Long enough that nothing finishes by itself while a test holds it (ignore_eos).
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}


@dataclass
class Stack:
    run_dir: Path
    http_url: str
    http_port: int
    grpc_addr: str
    ports: dict[str, int]

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.http_url, trust_env=False, timeout=60, headers=AUTH, **kw)

    def pid(self, service: str) -> int:
        return int((self.run_dir / f"{service}.pid").read_text())

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with self.http() as h:
            text = h.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_idle(self, timeout_s: float = 20.0) -> dict[Any, float]:
        """Every device and host block free, no live request in the scheduler or gateway."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            free = {t: (m[("superinfer_kv_blocks_free", (("tier", t),))],
                        m[("superinfer_kv_blocks_capacity", (("tier", t),))]) for t in ("device", "host")}
            live = sum(m[(f"superinfer_requests_{s}", ())] for s in ("running", "waiting", "rotary"))
            with self.http() as h:
                in_flight = h.get("/health").json()["in_flight"]
            if all(f == n for f, n in free.values()) and live == 0 and in_flight == 0:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"not idle after {timeout_s} s: blocks (free, total) {free}, "
                            f"{live} live requests, {in_flight} in flight at the gateway")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("hardened-stack")
    ports = {name: free_port() for name in (*SERVICES, "grpc")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    cli = [sys.executable, "-m", "superinfer.cli"]
    common = ["--run-dir", str(run_dir)]  # --host left at its default: loopback is checked
    specs = [
        ServiceSpec("worker", [*cli, "worker", *common, "--port", str(ports["worker"]),
                               "--device-blocks", "256"], grpc_probe(addr["worker"])),
        ServiceSpec("kvmem", [*cli, "kvmem", *common, "--port", str(ports["kvmem"]),
                              "--host-blocks", "256"], grpc_probe(addr["kvmem"])),
        ServiceSpec("scheduler", [*cli, "scheduler", *common, "--port", str(ports["scheduler"]),
                                  "--worker-addr", addr["worker"], "--kvmem-addr", addr["kvmem"],
                                  "--max-queued-requests", str(LIMIT),
                                  "--max-model-len", str(MAX_MODEL_LEN)],
                    grpc_probe(addr["scheduler"])),
        ServiceSpec("gateway", [*cli, "gateway", *common, "--port", str(ports["gateway"]),
                                "--grpc-port", str(ports["grpc"]), "--scheduler-addr",
                                addr["scheduler"], "--max-body-bytes", str(MAX_BODY)],
                    http_probe(f"http://{addr['gateway']}/health")),
    ]
    sup = Supervisor(run_dir)
    try:
        with _environment({**CHILD_ENV, "SUPERINFER_API_KEY": API_KEY}):
            for spec in specs:
                sup.start(spec, STARTUP_TIMEOUT_S)
        yield Stack(run_dir, f"http://{addr['gateway']}", ports["gateway"], addr["grpc"], ports)
    finally:
        sup.stop_all()


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return dict(body["error"])


def _channel(stack: Stack) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(stack.grpc_addr, options=[("grpc.enable_http_proxy", 0)])


async def _grpc_generate(stack: Stack, req: client_pb2.ClientGenerateRequest,
                         metadata: tuple[tuple[str, str], ...] = GRPC_AUTH
                         ) -> list[client_pb2.ClientGenerateEvent]:
    async with _channel(stack) as ch:
        stub = client_pb2_grpc.SuperInferStub(ch)
        return [e async for e in stub.Generate(req, metadata=metadata)]


async def _grpc_error(stack: Stack, req: client_pb2.ClientGenerateRequest,
                      metadata: tuple[tuple[str, str], ...] = GRPC_AUTH) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _grpc_generate(stack, req, metadata)
    return err.value


# -- admission control ------------------------------------------------------------------------------


def test_past_the_limit_429_and_resource_exhausted_then_serving_again(stack: Stack) -> None:
    rejected_before = stack.metrics()[("superinfer_requests_total", (("status", "rejected"),))]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=stack.http_url, trust_env=False, timeout=60,
                                     headers=AUTH) as c, contextlib.AsyncExitStack() as held:
            # LIMIT live requests, each seen producing tokens: the scheduler is full.
            streams = []  # kept: a dropped line iterator closes its connection

            async def hold(i: int) -> None:
                r = await held.enter_async_context(c.stream("POST", "/v1/completions", json={
                    "prompt": PROMPTS[i % len(PROMPTS)], **LONG}))
                assert r.status_code == 200
                streams.append(lines := r.aiter_lines())
                assert (await anext(lines)).startswith("data: ")

            await asyncio.gather(*(hold(i) for i in range(LIMIT)))

            r = await c.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = _error(r)
            assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
            assert "--max-queued-requests" in err["message"] and f"limit is {LIMIT}" in err["message"]
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"

            e = await _grpc_error(stack, client_pb2.ClientGenerateRequest(
                prompt="one too many", sampling=common_pb2.SamplingParams(max_tokens=2)))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert ("grpc-retry-pushback-ms", "1000") in tuple(e.trailing_metadata() or ())
            # The held streams close here: the clients hang up mid-generation.

    asyncio.run(main())
    m = stack.wait_idle()
    assert m[("superinfer_requests_total", (("status", "rejected"),))] >= rejected_before + 2
    with stack.http() as h:
        r = h.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    events = asyncio.run(_grpc_generate(stack, client_pb2.ClientGenerateRequest(
        prompt=PROMPTS[0], sampling=common_pb2.SamplingParams(max_tokens=4))))
    assert events[-1].completion_tokens == 4
    stack.wait_idle()


# -- size limits ------------------------------------------------------------------------------------


def test_oversized_input_gets_a_clear_4xx(stack: Stack) -> None:
    big = "word " * (MAX_BODY // 5 + 10)
    cases: list[tuple[dict[str, Any], int, str | None, str]] = [
        # (body, status, param, what the message must say)
        ({"prompt": big}, 413, None, "--max-body-bytes"),
        ({"prompt": "hi " * 2000}, 400, "prompt", "maximum context length is 256"),
        ({"prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt", "maximum context length"),
        ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "Reduce the prompt or max_tokens"),
        ({"prompt": "hi", "n": 33}, 400, "n", "32"),
        ({"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of", "best_of"),
        ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, 400, "stop", "at most 16"),
        ({"prompt": "hi", "stop": "x" * 257}, 400, "stop", "at most 256 characters"),
    ]
    with stack.http() as h:
        for body, status, param, says in cases:
            r = h.post("/v1/completions", json=body)
            assert r.status_code == status, (body.keys(), r.text[:300])
            err = _error(r)
            assert err["param"] == param and says in err["message"], err
        # A chunked upload has no Content-Length to refuse early; it is counted as it arrives.
        r = h.post("/v1/completions", headers={"content-type": "application/json"},
                   content=(part for part in [b'{"prompt": "', big.encode(), b'"}']))
        assert r.status_code == 413 and _error(r)["code"] == "body_too_large"
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]})
        assert r.status_code == 413

    async def grpc_cases() -> None:
        for req, says in [
            (client_pb2.ClientGenerateRequest(prompt="hi", stop=["x" * 257]), "256 characters"),
            (client_pb2.ClientGenerateRequest(prompt="hi", stop=["s"] * 17), "at most 16"),
            (client_pb2.ClientGenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
                stop_token_ids=list(range(65)))), "stop token ids"),
            (client_pb2.ClientGenerateRequest(prompt="hi " * 2000), "maximum context length"),
        ]:
            e = await _grpc_error(stack, req)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (e.details() or ""), e
        # Over --max-body-bytes, gRPC itself refuses the message.
        e = await _grpc_error(stack, client_pb2.ClientGenerateRequest(prompt=big))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e

    asyncio.run(grpc_cases())
    stack.wait_idle()


# -- security ---------------------------------------------------------------------------------------


def test_missing_or_wrong_api_key_is_401_on_both_front_doors(stack: Stack) -> None:
    with httpx.Client(base_url=stack.http_url, trust_env=False, timeout=30) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {API_KEY}x"},
                        {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions")):
                r = h.request(method, path, headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (headers, path, r.text)
                err = _error(r)
                assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        r = h.get("/v1/models", headers=AUTH)
        assert r.status_code == 200
        assert h.get("/health").status_code == 200  # probes stay open

    async def grpc_cases() -> None:
        req = client_pb2.ClientGenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
            max_tokens=2))
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)):
            e = await _grpc_error(stack, req, metadata)
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            async with _channel(stack) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as abort_err:
                    await client_pb2_grpc.SuperInferStub(ch).Abort(
                        client_pb2.ClientAbortRequest(request_id="x"), metadata=metadata)
                assert abort_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        events = await _grpc_generate(stack, req)
        assert events[-1].completion_tokens == 2

    asyncio.run(grpc_cases())
    # The key came from the environment, so no local user can read it from `ps`.
    cmdline = Path(f"/proc/{stack.pid('gateway')}/cmdline").read_bytes()
    assert API_KEY.encode() not in cmdline


def test_nothing_listens_beyond_loopback_and_the_kv_pool_is_private(stack: Stack) -> None:
    def loopback(ip: str) -> bool:  # gRPC listens on ::ffff:127.0.0.1, v4 loopback too
        addr = ipaddress.ip_address(ip)
        mapped = getattr(addr, "ipv4_mapped", None)
        return addr.is_loopback or (mapped is not None and mapped.is_loopback)

    expected = {"worker": {stack.ports["worker"]}, "kvmem": {stack.ports["kvmem"]},
                "scheduler": {stack.ports["scheduler"]},
                "gateway": {stack.ports["gateway"], stack.ports["grpc"]}}
    for service in SERVICES:
        proc = psutil.Process(stack.pid(service))
        listening = [c.laddr for c in proc.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening, service
        assert all(loopback(a.ip) for a in listening), (service, listening)
        assert {a.port for a in listening} == expected[service], (service, listening)

    # The worker's device pool: a shared-memory segment only its owner can open, with a
    # random name, that kvmem maps too.
    def shm_segments(service: str) -> set[str]:
        maps = Path(f"/proc/{stack.pid(service)}/maps").read_text()
        return set(re.findall(r"/dev/shm/(\S+)", maps))

    segments = shm_segments("worker")
    assert len(segments) == 1, segments
    (name,) = segments
    assert re.fullmatch(r"si-kv-[0-9a-f]{16}", name), name  # 64 random bits
    st = os.stat(f"/dev/shm/{name}")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert shm_segments("kvmem") == segments


# -- fuzzing ----------------------------------------------------------------------------------------


def test_schemathesis_fuzz_finds_no_server_error(stack: Stack) -> None:
    """Positive and negative cases for every operation in the OpenAPI schema; no 5xx.

    Fully random bodies rarely get past validation, so half of the POST cases graft one or
    two of the fuzzed fields onto a request that is otherwise valid, which reaches the
    tokenizer, the sampling checks, the scheduler and the stream. Each call is cut after
    ``call_s`` (a valid request may ask for the whole context): a client hanging up, whose
    request the server must free as well.
    """
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.core.result import Ok
    from schemathesis.generation import GenerationMode

    call_s = 1.5
    # A longer hunt than CI's: SUPERINFER_FUZZ_EXAMPLES=500 pytest -k schemathesis
    examples = int(os.environ.get("SUPERINFER_FUZZ_EXAMPLES", "30"))
    # CI runs a fixed set of cases (no flaky failures); a longer hunt explores at random.
    derandomize = "SUPERINFER_FUZZ_EXAMPLES" not in os.environ
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    valid = {"/v1/completions": {"prompt": "Hello", "max_tokens": 4},
             "/v1/chat/completions": chat,
             # What a router asks a replica (gateway/router_routes.py).
             "/v1/completions/render": {"prompt": "Hello"},
             "/v1/chat/completions/render": chat,
             "/tokenize": {"prompt": "Hello"}}
    with stack.http() as h:
        schema = schemathesis.openapi.from_dict(h.get("/openapi.json").json())
    results = list(schema.get_all_operations())
    operations = [r.ok() for r in results if isinstance(r, Ok)]
    assert len(operations) == len(results), "the gateway's OpenAPI schema does not load"
    assert set(valid) | {"/v1/models", "/health"} <= {op.path for op in operations}
    seen: dict[int, int] = {}
    failures: list[str] = []

    def call(h: httpx.Client, case: Any, graft: random.Random | None) -> None:
        if graft is not None and isinstance(case.body, dict) and case.body and case.path in valid:
            keys = graft.sample(sorted(case.body), k=min(len(case.body), graft.randint(1, 2)))
            case.body = {**valid[case.path], **{k: case.body[k] for k in keys}}
        kw = case.as_transport_kwargs(base_url=stack.http_url, headers=AUTH)
        body = json.dumps(kw["json"]).encode() if "json" in kw else kw.get("data")
        status, t0 = 0, time.monotonic()
        with contextlib.suppress(httpx.TimeoutException), h.stream(
                kw["method"], kw["url"], params=kw.get("params"), headers=kw.get("headers"),
                content=body, timeout=call_s) as r:
            status, text = r.status_code, b""
            for chunk in r.iter_bytes():
                text += chunk
                if time.monotonic() - t0 > call_s:
                    break
            if status >= 400:
                err = json.loads(text)["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
        seen[status] = seen.get(status, 0) + 1
        if status >= 500:
            failures.append(f"{status} for {kw['method']} {kw['url']} {body!r:.300}")

    with httpx.Client(trust_env=False) as h:
        for op in operations:
            post = op.method.upper() == "POST"
            for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE][: 1 + post]:
                grafts = st.none() | st.randoms(use_true_random=False) if post else st.none()

                @settings(max_examples=examples if post else 3, deadline=None, database=None,
                          derandomize=derandomize, suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode), graft=grafts)
                def fuzz(case: Any, graft: random.Random | None) -> None:
                    call(h, case, graft)  # noqa: B023 - runs inside this iteration

                fuzz()
    print(f"schemathesis: responses by status {dict(sorted(seen.items()))}")
    assert not failures, failures[:5]
    assert seen.get(200, 0) >= 3 and sum(n for s, n in seen.items() if 400 <= s < 500) > 10
    with stack.http() as h:
        assert h.get("/health").status_code == 200
    stack.wait_idle()


# -- clients that hang up ---------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


async def _hang_up(stack: Stack, i: int, stats: dict[str, int]) -> None:
    """One raw HTTP client: send a streaming request, read a chunk or two, drop the line.

    Every third client resets the connection (SO_LINGER 0: RST, no FIN), every tenth
    leaves before the first token arrives; 429s are retried, as a client should.
    """
    body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], **LONG}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"X-Request-ID: hangup-{i}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    while True:
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.http_port)
        try:
            writer.write(head + body)
            await writer.drain()
            if i % 10 == 0:
                await asyncio.sleep(0.01)
                stats["before_first_token"] += 1
                return
            status_line = await reader.readline()
            if b" 429 " in status_line:
                stats["retried_429"] += 1
                await asyncio.sleep(0.05)
                continue
            assert b" 200 " in status_line, status_line
            want, events = 1 + i % 2, 0
            while events < want:
                line = await reader.readline()
                assert line, "stream ended early"
                events += line.startswith(b"data: ")
            stats["mid_stream"] += 1
            return
        finally:
            if i % 3 == 0:
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


ABORTS = ("superinfer_requests_total", (("status", "abort"),))


def _disconnect_storm(stack: Stack, n: int, wave: int = LIMIT) -> None:
    # The counter is the stack's running total (other tests abort too): count this storm's.
    aborts_before = stack.wait_idle().get(ABORTS, 0.0)
    pids = {s: stack.pid(s) for s in ("gateway", "scheduler")}
    before = {s: _rss_kib(p) for s, p in pids.items()}
    stats = {"mid_stream": 0, "before_first_token": 0, "retried_429": 0}

    async def main() -> None:
        # At most `wave` clients at a time (a 2-core machine serves them all), each slot
        # taken again as soon as its client has hung up.
        slots = asyncio.Semaphore(wave)

        async def client(i: int) -> None:
            async with slots:
                await _hang_up(stack, i, stats)

        await asyncio.gather(*(client(i) for i in range(n)))

    t0 = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - t0
    m = stack.wait_idle(timeout_s=30)
    after = {s: _rss_kib(p) for s, p in pids.items()}
    growth = {s: (after[s] - before[s]) / 1024 for s in pids}
    print(f"{n} hang-ups in {elapsed:.1f} s {stats}; RSS MiB before/after: "
          + ", ".join(f"{s} {before[s] / 1024:.0f}/{after[s] / 1024:.0f} ({growth[s]:+.1f})"
                      for s in pids))
    assert stats["mid_stream"] + stats["before_first_token"] == n
    aborted = m.get(ABORTS, 0.0) - aborts_before
    # Every client that hung up mid-stream was aborted, and nothing but this storm's were.
    assert stats["mid_stream"] <= aborted <= n, (aborted, stats)
    for service, mib in growth.items():
        assert mib < 50, f"{service} RSS grew {mib:.1f} MiB over {n} hang-ups"
    with stack.http() as h:
        r = h.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_500_clients_hanging_up_mid_stream_leave_nothing_behind(stack: Stack) -> None:
    _disconnect_storm(stack, 500)
