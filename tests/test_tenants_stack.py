"""Tenants through real worker/kvmem/scheduler/gateway processes.

One stack for the module, its gateway started with a tenants file (no single API key) and
a scheduler that runs one request at a time, so that who goes first is visible. What a
tenant notices: an unknown key is a 401 on both front doors; its limits answer 429 with
Retry-After and OpenAI's x-ratelimit-* headers; its more urgent request overtakes its own
queued ones; a SIGHUP reload under load drops no request, and a bad file is refused and
changes nothing. A bad file at start stops `serve` and the gateway with its line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from common.daemon import free_port
from common.tenants import hash_key, new_key
from proto import client_pb2, client_pb2_grpc, common_pb2
from superinfer.probes import grpc_probe, http_probe
from superinfer.supervisor import ServiceSpec, Supervisor
from tests.stack import CHILD_ENV, STARTUP_TIMEOUT_S
from tests.stack import environment as _environment

SERVICES = ("worker", "kvmem", "scheduler", "gateway")
KEYS = {name: new_key() for name in ("ops", "capped", "metered", "bulk", "late")}
METERED_TPM = 60  # one token a second


def _file(with_late: bool = False) -> str:
    def entry(name: str, extra: str = "") -> str:
        return f'[tenants.{name}]\nkeys = ["{hash_key(KEYS[name])}"]\n{extra}\n'

    return (entry("ops", "priority = 1\nttft_slo = 30\n")
            + entry("capped", "max_in_flight = 1\n")
            + entry("metered", f"tokens_per_minute = {METERED_TPM}\n")
            + entry("bulk", "priority = 5\n")
            + (entry("late") if with_late else ""))


@dataclass
class Stack:
    run_dir: Path
    url: str
    grpc_addr: str
    tenants: Path

    def client(self, tenant: str | None, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
        return httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=120,
                                 headers=headers, **kw)

    def reload(self, text: str) -> None:
        self.tenants.write_text(text)
        os.kill(int((self.run_dir / "gateway.pid").read_text()), signal.SIGHUP)

    def log_lines(self, service: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (self.run_dir / f"{service}.log").read_text().splitlines()
                if x.startswith("{")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("tenants-stack")
    tenants = run_dir / "tenants.toml"
    tenants.write_text(_file())
    ports = {name: free_port() for name in (*SERVICES, "grpc")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    cli = [sys.executable, "-m", "superinfer.cli"]
    common = ["--run-dir", str(run_dir)]
    specs = [
        ServiceSpec("worker", [*cli, "worker", *common, "--port", str(ports["worker"]),
                               "--device-blocks", "256"], grpc_probe(addr["worker"])),
        ServiceSpec("kvmem", [*cli, "kvmem", *common, "--port", str(ports["kvmem"]),
                              "--host-blocks", "256"], grpc_probe(addr["kvmem"])),
        ServiceSpec("scheduler", [*cli, "scheduler", *common, "--port", str(ports["scheduler"]),
                                  "--worker-addr", addr["worker"], "--kvmem-addr", addr["kvmem"],
                                  "--max-num-seqs", "1"],
                    grpc_probe(addr["scheduler"])),
        ServiceSpec("gateway", [*cli, "gateway", *common, "--port", str(ports["gateway"]),
                                "--grpc-port", str(ports["grpc"]), "--scheduler-addr",
                                addr["scheduler"], "--tenants", str(tenants)],
                    http_probe(f"http://{addr['gateway']}/health")),
    ]
    sup = Supervisor(run_dir)
    env = {k: v for k, v in os.environ.items() if k != "SUPERINFER_API_KEY"}
    try:
        with _environment({**CHILD_ENV}):
            os.environ.pop("SUPERINFER_API_KEY", None)
            for spec in specs:
                sup.start(spec, STARTUP_TIMEOUT_S)
        yield Stack(run_dir, f"http://{addr['gateway']}", addr["grpc"], tenants)
    finally:
        sup.stop_all()
        os.environ.clear()
        os.environ.update(env)


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion: its status, text, first-token time and finish reason."""
    out: dict[str, Any] = {"text": "", "first": None, "finish": None}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        out["headers"] = r.headers
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["text"] and out["first"] is None:
                out["first"] = time.monotonic()
            out["text"] += choice["text"]
            out["finish"] = choice["finish_reason"] or out["finish"]
    return out


def test_an_unknown_key_is_a_401_on_both_front_doors(stack: Stack) -> None:
    async def main() -> None:
        for headers in ({}, {"Authorization": "Bearer sk-si-nobody"}):
            async with httpx.AsyncClient(base_url=stack.url, trust_env=False, headers=headers) as c:
                r = await c.post("/v1/completions", json=_body("Hi", 2))
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        async with grpc.aio.insecure_channel(stack.grpc_addr) as ch:
            stub = client_pb2_grpc.SuperInferStub(ch)
            # max_tokens set: proto3's 0 means "up to the context", 8k tokens on this CPU.
            req = client_pb2.ClientGenerateRequest(
                prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=2))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [e async for e in stub.Generate(
                    req, metadata=(("authorization", "Bearer sk-si-nobody"),))]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            events = [e async for e in stub.Generate(
                req, metadata=(("authorization", f"Bearer {KEYS['ops']}"),))]
            assert events[-1].finish_reason
        async with stack.client("ops") as c:  # /metrics and /health stay open
            assert (await c.get("/health")).status_code == 200

    asyncio.run(main())


def test_over_its_in_flight_limit_a_tenant_gets_429_and_others_do_not(stack: Stack) -> None:
    async def main() -> None:
        async with stack.client("capped") as capped, stack.client("ops") as ops:
            first = asyncio.create_task(_stream(capped, _body("Once upon a time", 48)))
            while not first.done() and not (await ops.get("/health")).json().get("in_flight"):
                await asyncio.sleep(0.02)
            r = await capped.post("/v1/completions", json=_body("Hello", 2))
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.headers["x-ratelimit-limit-requests"] == "1"
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
            assert "max_in_flight" in r.json()["error"]["message"]
            other = await ops.post("/v1/completions", json=_body("Hello", 2))
            assert other.status_code == 200  # another tenant is not held back by it
            done = await first
            assert done["status"] == 200 and done["finish"] == "length"
            assert done["headers"]["x-ratelimit-limit-requests"] == "1"
            again = await capped.post("/v1/completions", json=_body("Hello", 2))
            assert again.status_code == 200
            # Counted while this response starts: it holds the one slot itself.
            assert again.headers["x-ratelimit-remaining-requests"] == "0"

    asyncio.run(main())


def test_over_its_token_rate_a_tenant_gets_429_with_the_wait(stack: Stack) -> None:
    async def main() -> None:
        async with stack.client("metered") as c:
            ok = await c.post("/v1/completions", json=_body("The capital of France is", 58))
            assert ok.status_code == 200
            assert ok.json()["usage"]["total_tokens"] > METERED_TPM  # the bucket is empty now
            r = await c.post("/v1/completions", json=_body("The capital of Spain is", 4))
            assert r.status_code == 429, r.text
            wait = int(r.headers["retry-after"])
            assert 1 <= wait <= 60
            assert r.headers["x-ratelimit-limit-tokens"] == str(METERED_TPM)
            assert int(r.headers["x-ratelimit-remaining-tokens"]) < 5
            assert "tokens_per_minute" in r.json()["error"]["message"]

    asyncio.run(main())


def test_a_more_urgent_request_overtakes_its_tenants_queued_ones(stack: Stack) -> None:
    """One seat (--max-num-seqs 1): while a long request holds it, two requests of priority
    5 queue, then one of priority 1 (the tenant's own bound) arrives last and goes first.
    A priority above the tenant's own (0 < 1) is bounded to it, not refused."""
    async def main() -> None:
        async with stack.client("ops") as c:
            hold = asyncio.create_task(_stream(c, _body("Once upon a time", 40, priority=5)))
            while True:  # the long one holds the seat once its first token is out
                await asyncio.sleep(0.02)
                if hold.done() or (await c.get("/metrics")).text.count("superinfer_requests_running 1.0"):
                    break
            low = [asyncio.create_task(_stream(c, _body(p, 4, priority=5)))
                   for p in ("1, 2, 3,", "def add(a, b):")]
            await asyncio.sleep(0.05)
            high = asyncio.create_task(_stream(c, _body("The quick brown fox", 4, priority=0)))
            done = await asyncio.gather(hold, *low, high)
        assert all(d["status"] == 200 and d["finish"] == "length" for d in done), done
        first_high = done[-1]["first"]
        assert all(first_high < d["first"] for d in done[1:3]), [d["first"] for d in done]

    asyncio.run(main())


def test_a_reload_under_load_drops_nothing_and_a_bad_file_changes_nothing(stack: Stack) -> None:
    async def main() -> None:
        async with stack.client("bulk") as bulk, stack.client("late") as late:
            assert (await late.post("/v1/completions", json=_body("Hi", 2))).status_code == 401
            tasks = [asyncio.create_task(_stream(bulk, _body(p, 24)))
                     for p in ("The capital of France is", "Once upon a time", "In the beginning",
                               "My favourite colour is", "Water boils at", "The quick brown fox")]
            await asyncio.sleep(0.5)
            stack.reload(_file(with_late=True))
            done = await asyncio.gather(*tasks)
            assert all(d["status"] == 200 and d["finish"] == "length" and d["text"]
                       for d in done), done
            assert (await late.post("/v1/completions", json=_body("Hi", 2))).status_code == 200
            tasks = [asyncio.create_task(_stream(late, _body("Once upon a time", 24)))
                     for _ in range(3)]
            await asyncio.sleep(0.3)
            bad = _file(with_late=True).replace("max_in_flight = 1", "max_in_flight = -1")
            stack.reload(bad)
            done = await asyncio.gather(*tasks)
            assert all(d["status"] == 200 and d["finish"] == "length" for d in done), done
            await asyncio.sleep(0.2)
            # The old file still holds: late's key works, capped's limit is still 1.
            assert (await late.post("/v1/completions", json=_body("Hi", 2))).status_code == 200
        refused = [x for x in stack.log_lines("gateway") if x.get("event", "").startswith(
            "tenants file refused")]
        assert refused and f"{stack.tenants}:" in refused[-1]["error"]
        assert "max_in_flight must be >= 1" in refused[-1]["error"]
        reloaded = [x for x in stack.log_lines("gateway") if x.get("event") == "tenants reloaded"]
        assert reloaded and reloaded[0]["added"] == ["late"]
        finished = [x for x in stack.log_lines("gateway") if x.get("event") == "request finished"]
        assert {x.get("tenant") for x in finished} >= {"bulk", "late"}
        stack.reload(_file())

    asyncio.run(main())


def test_a_bad_tenants_file_stops_serve_and_the_gateway_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.toml"
    bad.write_text(_file().replace("priority = 5", "priority = 5.5"))
    env = {k: v for k, v in os.environ.items() if k != "SUPERINFER_API_KEY"}
    cli = [sys.executable, "-m", "superinfer.cli"]
    serve = subprocess.run([*cli, "serve", "--tenants", str(bad), "--run-dir", str(tmp_path / "s"),
                            "--port", str(free_port())], capture_output=True, text=True,
                           timeout=120, env=env)
    assert serve.returncode == 2
    line = _file().splitlines().index("priority = 5") + 1
    assert f"{bad}:{line}: tenants.bulk.priority must be an integer" in serve.stderr
    assert "nothing was started" in serve.stderr
    gw = subprocess.run([*cli, "gateway", "--tenants", str(bad), "--run-dir", str(tmp_path / "g"),
                         "--port", str(free_port()), "--grpc-port", "0"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert gw.returncode == 2
    assert f"{bad}:{line}:" in gw.stdout + gw.stderr
    good = tmp_path / "good.toml"
    good.write_text(_file())
    with_key = subprocess.run([*cli, "serve", "--tenants", str(good),
                               "--run-dir", str(tmp_path / "k")], capture_output=True, text=True,
                              timeout=120, env={**env, "SUPERINFER_API_KEY": "k"})
    assert with_key.returncode == 2 and "SUPERINFER_API_KEY" in with_key.stderr


def test_bench_serve_reports_each_tenant_as_the_server_counted_it(stack: Stack,
                                                                  tmp_path: Path) -> None:
    """Two tenants through `bench serve --tenant`: a row each, and the counts it measured
    from its own side equal the server's tenant-labelled /metrics (within one request)."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "KEY_OPS": KEYS["ops"], "KEY_BULK": KEYS["bulk"]}
    run = subprocess.run(
        [sys.executable, "-m", "superinfer.cli", "bench", "serve", "--base-url", f"{stack.url}/v1",
         "--dataset", "sharegpt", "--no-progress", "--json", str(out),
         "--tenant", "name=ops,key-env=KEY_OPS,rps=4,num-prompts=5,max-prompt-len=24,"
                     "max-output-len=8,ttft-slo=0.5,tbt-slo=0.5",
         "--tenant", "name=bulk,key-env=KEY_BULK,rps=4,num-prompts=5,max-prompt-len=48,"
                     "max-output-len=8,ttft-slo=60,tbt-slo=5"],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert KEYS["ops"] not in out.read_text()  # the keys stay out of the result file
    rows = {r["tenant"]: r for r in json.loads(out.read_text())["tenants"]}
    assert set(rows) == {"ops", "bulk"}
    for name, r in rows.items():
        bench, server = r["counts"]["bench"], r["counts"]["server"]
        assert server is not None, f"no tenant={name} series on /metrics"
        assert bench["ttft_met"] + bench["ttft_missed"] == 5 == server["ttft_met"] + server["ttft_missed"]
        assert abs(bench["ttft_met"] - server["ttft_met"]) <= 1, (name, bench, server)
        assert abs(bench["good"] - server["good"]) <= 1, (name, bench, server)
        assert r["agree"] is True
        assert next(line for line in run.stdout.splitlines() if line.strip().startswith(name))
    # The loose SLOs are met in full on both sides; the tight ones need not be.
    assert rows["bulk"]["counts"]["server"]["ttft_met"] == 5
    # One seat: ops' misses waited behind the requests that held it, bulk's or its own.
    ops = rows["ops"]
    assert set(ops["blame_s"]) <= {"ops", "bulk"}
    if ops["counts"]["server"]["ttft_missed"]:
        assert sum(ops["blame_s"].values()) > 0
        assert "ops's misses:" in run.stdout
