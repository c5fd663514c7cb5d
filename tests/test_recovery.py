"""Kill services under load (DESIGN §6): `superinfer serve` restarts them, nothing is lost.

One real `superinfer serve` (worker, kvmem, scheduler, gateway) with a small device pool,
so that requests rotate and host copies exist. Clients stream greedy completions over
the OpenAI API while a service is killed with SIGKILL:
* worker, then kvmem: every request completes with the text of an undisturbed run;
* kvmem stopped with SIGSTOP (alive, silent): the supervisor kills it once it has answered
  no health check for --liveness-timeout, restarts it, and every request completes as above;
* scheduler: in-flight streams end with a clear error event, the gateway answers 503
  with Retry-After while it is down and serves again once the supervisor restarted it;
  the worker and kvmem keep running.
After every scenario no KV block is leaked in either pool and no shared-memory segment
of ours is left in /dev/shm; a final SIGTERM under load stops everything cleanly.
Recovery times (kill -> next token to any client) are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from common.daemon import CHANNEL_OPTIONS, free_port
from proto import scheduler_pb2, scheduler_pb2_grpc
from tests.prompts import PROMPTS

MAX_TOKENS = 128  # long enough that the load outlasts both kills with the fast executor
START_TIMEOUT_S = 240.0
# 8 requests of ~5 blocks against 24 device blocks: rotation all the way through.
DEVICE_BLOCKS = 24
LIVENESS_TIMEOUT_S = 3.0




@dataclass
class Serve:
    proc: subprocess.Popen[bytes]
    run_dir: Path
    url: str
    scheduler_addr: str
    model: str = ""
    segments: set[str] = field(default_factory=set)  # every device pool segment seen

    def pid(self, service: str) -> int:
        return int((self.run_dir / f"{service}.pid").read_text())

    def stats(self) -> scheduler_pb2.StatsReply:
        with grpc.insecure_channel(self.scheduler_addr, options=CHANNEL_OPTIONS) as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(
                scheduler_pb2.StatsRequest(), timeout=10)

    def note_segment(self) -> str:
        """The worker's current pool segment (from its record in the run dir)."""
        record = json.loads((self.run_dir / "worker.shm").read_text())
        assert record["pid"] == self.pid("worker")
        [name] = record["segments"]
        self.segments.add(name)
        return name

    def log_events(self, service: str, event: str) -> list[dict[str, Any]]:
        path = self.run_dir / f"{service}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e.get("event") == event]


def _wait_ready(serve: Serve, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.proc.poll() is not None:
            raise RuntimeError(f"serve exited with {serve.proc.returncode}: "
                               f"{(serve.run_dir / 'serve.err').read_text()[-3000:]}")
        try:
            r = httpx.get(f"{serve.url}/v1/models", timeout=2, trust_env=False)
            if r.status_code == 200:
                serve.model = r.json()["data"][0]["id"]
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"serve not ready after {timeout_s} s")


@contextlib.contextmanager
def serving(run_dir: Path, *extra: str) -> Iterator[Serve]:
    """`superinfer serve` in its own process on free ports, ready, then SIGTERM."""
    ports = {n: free_port() for n in ("http", "scheduler", "worker", "kvmem")}
    argv = [
        sys.executable, "-m", "superinfer.cli", "serve", "--run-dir", str(run_dir),
        "--port", str(ports["http"]), "--grpc-port", "0",
        "--scheduler-port", str(ports["scheduler"]), "--worker-port", str(ports["worker"]),
        "--kvmem-port", str(ports["kvmem"]), "--device-blocks", str(DEVICE_BLOCKS),
        "--host-blocks", "256", "--restart-backoff", "0.1", "--shutdown-grace", "2", *extra,
    ]
    with (run_dir / "serve.out").open("wb") as out, (run_dir / "serve.err").open("wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    s = Serve(proc, run_dir, f"http://127.0.0.1:{ports['http']}",
              f"127.0.0.1:{ports['scheduler']}")
    try:
        _wait_ready(s, START_TIMEOUT_S)
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with serving(tmp_path_factory.mktemp("recovery"),
                 "--liveness-timeout", str(LIVENESS_TIMEOUT_S)) as s:
        s.note_segment()
        yield s


# -- clients ----------------------------------------------------------------------------------
@dataclass
class Stream:
    """One streaming completion as its client saw it."""

    text: str = ""
    token_times: list[float] = field(default_factory=list)  # monotonic, one per text chunk
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False  # got `data: [DONE]`


async def stream_completion(client: httpx.AsyncClient, serve: Serve, prompt: str,
                            out: Stream, max_tokens: int = MAX_TOKENS,
                            extra: dict[str, Any] | None = None) -> Stream:
    body = {"model": serve.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, **(extra or {})}
    async with client.stream("POST", f"{serve.url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out.error = data["error"]
                continue
            choice = data["choices"][0]
            if choice["text"]:
                out.text += choice["text"]
                out.token_times.append(time.monotonic())
            out.finish_reason = choice["finish_reason"] or out.finish_reason
    return out


def run_load(serve: Serve, prompts: list[str], during: Any = None,
             max_tokens: int = MAX_TOKENS, extra: dict[str, Any] | None = None,
             ) -> list[Stream]:
    """Stream every prompt at once; `during(streams)` (async) runs alongside; `extra`:
    more fields of each body."""

    async def main() -> list[Stream]:
        streams = [Stream() for _ in prompts]
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            tasks = [asyncio.create_task(stream_completion(client, serve, p, s, max_tokens,
                                                           extra))
                     for p, s in zip(prompts, streams, strict=True)]
            if during is not None:
                await during(streams, tasks)
            await asyncio.gather(*tasks)
        return streams

    return asyncio.run(main())


async def until(cond: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.02)


def mean_tokens(streams: list[Stream]) -> float:
    """Tokens per stream on average. Waiting on this, not on the slowest stream, bounds how
    many can have finished: from 16 tokens in, a stream needs 112 more to end, so a rise of
    the mean by 16-24 tokens (8 streams) ends at most one or two, however the scheduler
    shares the seats (on the minimum, 5 of 8 once ended in the same iteration, the others
    parked)."""
    return sum(len(s.token_times) for s in streams) / len(streams)


def kill(serve: Serve, service: str) -> tuple[int, float]:
    pid = serve.pid(service)
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


async def next_token_after(streams: list[Stream], t: float) -> float:
    """Seconds from `t` to the first token any client received after it."""
    await until(lambda: any(x > t for s in streams for x in s.token_times))
    return min(x for s in streams for x in s.token_times if x > t) - t


def wait_restarted(serve: Serve, service: str, old_pid: int, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = serve.pid(service)
        except (OSError, ValueError):
            pid = old_pid
        if pid != old_pid and any(e["service"] == service and e["pid"] == pid
                                  for e in serve.log_events("supervisor", "service_restarted")):
            return pid
        time.sleep(0.1)
    raise TimeoutError(f"{service} was not restarted")


def assert_clean(serve: Serve) -> None:
    """Nothing live, every block of both pools free, no segment of ours but the live pool."""
    deadline = time.monotonic() + 20
    while True:
        s = serve.stats()
        if (s.waiting, s.running, s.rotary) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (s.waiting, s.running, s.rotary) == (0, 0, 0)
    assert s.device_blocks_free == s.device_blocks_total == DEVICE_BLOCKS
    assert s.host_blocks_free == s.host_blocks_total
    live = serve.note_segment()
    leftover = {n for n in serve.segments if os.path.exists(f"/dev/shm/{n}")}
    assert leftover == {live}


# -- tests ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(serve: Serve) -> dict[str, str]:
    """Every prompt's text from an undisturbed run: what each disturbed run must reproduce."""
    streams = run_load(serve, PROMPTS)
    for s in streams:
        assert s.error is None and s.finish_reason == "length" and s.done
        assert s.text
    return {p: s.text for p, s in zip(PROMPTS, streams, strict=True)}


def test_undisturbed_reference(serve: Serve, reference: dict[str, str]) -> None:
    assert sorted(reference) == sorted(PROMPTS)
    assert serve.stats().counters["rotations"] > 0  # the pool is tight enough to rotate
    assert_clean(serve)


def test_only_the_worker_and_kvmem_load_torch(serve: Serve) -> None:
    """Under serve, after a load: the supervisor, gateway and scheduler compute no tensor,
    so none maps libtorch, and each stays light (<= 150 MB resident)."""
    pids = {name: serve.pid(name) for name in ("gateway", "scheduler", "worker", "kvmem")}
    pids["supervisor"] = serve.proc.pid

    def mapped(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    def rss_mb(pid: int) -> float:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    for name in ("supervisor", "gateway", "scheduler"):
        assert not mapped(pids[name]), f"{name} maps libtorch"
        assert rss_mb(pids[name]) <= 150, f"{name}: {rss_mb(pids[name]):.0f} MB resident"
    assert mapped(pids["worker"]) and mapped(pids["kvmem"])


# Prompts sharing a long prefix, two of them sent twice: with prefix caching (on by default)
# requests share blocks on the device and their host copies, which the kills take away.
SHARED = ("You are a helpful assistant for a small town library. Answer briefly, in plain "
          "English, and never make up facts. The library opens at nine and closes at six, "
          "except on Sundays and public holidays, when it stays closed all day long. ")
SHARED_PROMPTS = [SHARED + p for p in PROMPTS[:6]] + [SHARED + PROMPTS[0], SHARED + PROMPTS[3]]


def test_kill_worker_then_kvmem_under_load_with_cached_prefixes(serve: Serve) -> None:
    """kill -9 of the worker, then of kvmem, under a load that rotates and shares cached
    prefix blocks (on the device and their host copies): every stream finishes unchanged,
    the worker's loss is repaired from host copies, and the cache serves again afterwards
    (from what survived; a lost tier is dropped, not served)."""
    old_segment = serve.note_segment()
    run_load(serve, SHARED_PROMPTS[:1])  # its blocks cached: the load below finds them
    warm = run_load(serve, SHARED_PROMPTS)  # undisturbed: the reference, and a warm cache
    want = [s.text for s in warm]
    assert all(s.error is None and s.finish_reason == "length" for s in warm)
    c0 = serve.stats().counters
    assert c0["prefix_cache_hits"] > 0
    before = {k: c0[k] for k in ("device_losses", "host_losses", "prefix_cache_hits",
                                 "prefix_cache_host_hits", "resumed_swap_in", "recoveries")}
    times: dict[str, float] = {}

    async def chaos(streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
        # Every request well into its output (host copies of its synced blocks exist).
        await until(lambda: min(len(s.token_times) for s in streams) >= 16)
        _, t = kill(serve, "worker")  # the device tier goes; the host tier's copies survive
        times["worker"] = await next_token_after(streams, t)
        # By 40 tokens on average the requests outgrow the device pool: some are rotary.
        await until(lambda: mean_tokens(streams) >= 40)
        assert sum(not t.done() for t in tasks) >= 4, "the load ended before kvmem was killed"
        _, t = kill(serve, "kvmem")  # and now the host tier goes too
        times["kvmem"] = await next_token_after(streams, t)

    streams = run_load(serve, SHARED_PROMPTS, chaos)
    print(f"\nrecovery time, kill -9 -> next token to any client: worker "
          f"{times['worker']:.2f} s, kvmem {times['kvmem']:.2f} s")
    for s, text in zip(streams, want, strict=True):
        assert s.error is None and s.finish_reason == "length" and s.done
        assert s.text == text, "a stream changed by the restarts"
    c = serve.stats().counters
    assert c["device_losses"] == before["device_losses"] + 1
    assert c["host_losses"] == before["host_losses"] + 1
    assert c["recoveries"] >= before["recoveries"] + 2
    assert c["resumed_swap_in"] > before["resumed_swap_in"]  # repaired from host copies
    assert not os.path.exists(f"/dev/shm/{old_segment}")  # the dead worker's pool is gone
    again = run_load(serve, SHARED_PROMPTS)  # on the new pools, filled since the kills
    assert [s.text for s in again] == want
    c = serve.stats().counters
    assert c["prefix_cache_hits"] > before["prefix_cache_hits"]
    print(f"prefix cache, both runs after the warm one: device hits "
          f"{c['prefix_cache_hits'] - before['prefix_cache_hits']:.0f} tokens, host hits "
          f"{c['prefix_cache_host_hits'] - before['prefix_cache_host_hits']:.0f}")
    assert_clean(serve)


def test_stopped_kvmem_is_killed_and_restarted_under_load(serve: Serve,
                                                          reference: dict[str, str]) -> None:
    pids: dict[str, int] = {}
    times: dict[str, float] = {}

    async def chaos(streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
        await until(lambda: min(len(s.token_times) for s in streams) >= 24)  # rotating by now
        pids["old"] = pid = serve.pid("kvmem")
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        pids["new"] = await asyncio.to_thread(wait_restarted, serve, "kvmem", pid)
        times["restarted"] = time.monotonic() - t

    try:
        streams = run_load(serve, PROMPTS, chaos)
    finally:
        if "old" in pids and "new" not in pids:
            os.kill(pids["old"], signal.SIGCONT)  # never leave a stopped process behind
    print(f"\nSIGSTOP kvmem -> restarted: {times['restarted']:.2f} s "
          f"(--liveness-timeout {LIVENESS_TIMEOUT_S:g})")
    [event] = [e for e in serve.log_events("supervisor", "service_unresponsive")
               if e["pid"] == pids["old"]]
    assert event["service"] == "kvmem" and event["silent_s"] >= LIVENESS_TIMEOUT_S
    assert times["restarted"] >= LIVENESS_TIMEOUT_S
    for p, s in zip(PROMPTS, streams, strict=True):
        assert s.error is None and s.finish_reason == "length" and s.done
        assert s.text == reference[p], f"{p!r} changed by the restart"
    assert_clean(serve)


def test_kill_scheduler_under_load(serve: Serve, reference: dict[str, str]) -> None:
    others = {name: serve.pid(name) for name in ("worker", "kvmem", "gateway")}
    old = serve.pid("scheduler")
    down: dict[str, Any] = {}

    async def chaos(streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
        await until(lambda: min(len(s.token_times) for s in streams) >= 4)
        _, down["t"] = kill(serve, "scheduler")
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
            r = await client.post(f"{serve.url}/v1/completions", json={
                "model": serve.model, "prompt": PROMPTS[0], "max_tokens": 4})
            down["status"], down["headers"], down["body"] = r.status_code, r.headers, r.json()

    streams = run_load(serve, PROMPTS[:4], chaos)
    for s in streams:  # each ended with an error event, not a silent cut or a fake finish
        assert s.error is not None and s.finish_reason is None and s.done
        assert s.error["code"] == "scheduler_unavailable" and "retry" in s.error["message"]
    assert down["status"] == 503 and down["headers"]["retry-after"]
    assert down["body"]["error"]["code"] == "scheduler_unavailable"

    wait_restarted(serve, "scheduler", old)
    deadline = time.monotonic() + 60
    while True:  # a client that honours Retry-After gets served once it is back
        r = httpx.post(f"{serve.url}/v1/completions", timeout=120, trust_env=False, json={
            "model": serve.model, "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code == 503
        time.sleep(float(r.headers["retry-after"]) / 4)
    assert r.status_code == 200, r.text
    print(f"\nscheduler kill -9 -> a new 16-token request completed: {time.monotonic() - down['t']:.2f} s")
    assert reference[PROMPTS[1]].startswith(r.json()["choices"][0]["text"])
    assert {name: serve.pid(name) for name in others} == others  # nobody else restarted
    assert_clean(serve)


def test_sigterm_under_load_stops_everything_cleanly(serve: Serve) -> None:
    pids = {name: serve.pid(name) for name in ("worker", "kvmem", "scheduler", "gateway")}
    result: dict[str, Any] = {}

    async def stop(streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
        await until(lambda: min(len(s.token_times) for s in streams) >= 2)
        t0 = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        result["rc"] = await asyncio.to_thread(serve.proc.wait, 60)
        result["stop_s"] = time.monotonic() - t0

    streams = run_load(serve, PROMPTS[:4], stop)
    print(f"\nserve stopped in {result['stop_s']:.1f} s (grace 2 s)")
    assert result["rc"] == 0
    for s in streams:  # finished within the grace period, or cancelled with a clear error
        cancelled = s.error is not None and "shutting down" in s.error["message"]
        assert s.done and (s.finish_reason == "length" or cancelled)
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in serve.segments)
    assert not list(serve.run_dir.glob("*.pid"))
    assert not list(serve.run_dir.glob("*.shm"))
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
