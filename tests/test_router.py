"""SuperInfer replicas behind the real vllm-router (PyPI, pinned), on loopback.

One deployment for the module: `superinfer replicas` starts two replicas (small device
pools, so prefixes rotate to host memory) and vllm-router with `kv_aware` on the replicas'
KV events; beside it two more routers over the same replicas: `cache_aware` (the router's
own tree of the text it routed) and `kv_aware` with host blocks credited 0 (as if the host
tier were not reported). What is checked is what a user of the router notices: which
replica answers (X-SuperInfer-Replica), its prefix hits (usage.cached_tokens), the
router's own kv_aware decisions (its debug log), errors and timings. The heavier
measurement (TTFT against round_robin, the bench table) is `python -m experiments
replicas` (docs/results/replicas/).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from common.daemon import free_port, read_pid
from experiments.router_client import Session, Turn, chat, kv_decisions, locality, run_sessions

DEVICE_BLOCKS = 32  # 512 tokens: a session's history leaves the device before its next turn
HOST_BLOCKS = 512
START_TIMEOUT_S = 420.0
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
CLI = [sys.executable, "-m", "superinfer.cli"]
ROUTER = str(Path(sys.executable).parent / "vllm-router")


def _free_block(n: int) -> int:
    """A base port with n free ports from it (below the kernel's ephemeral range)."""
    for _ in range(200):
        base = free_port()
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no block of free ports")


@dataclass
class Replica:
    name: str
    url: str
    run_dir: Path
    events: str
    replay: str


@dataclass
class Deployment:
    router: str  # kv_aware, host blocks credited at the router's default 0.8
    cache_aware: str
    device_only: str  # kv_aware with --kv-penalty-host 0
    router_log: Path
    replicas: list[Replica]
    model: str

    def replica(self, name: str | None) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def other(self, name: str | None) -> Replica:
        return next(r for r in self.replicas if r.name != name)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
               log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as h:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log else ""
                raise AssertionError(f"exited with {proc.returncode} before {url}:\n{tail}")
            try:
                if h.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"{url} not ready after {timeout_s} s")


def _wait_router_sees(router: str, worker: str, healthy: bool, timeout_s: float) -> float:
    """Seconds until the router's own view of `worker` (its GET /workers) is `healthy`."""
    start = time.perf_counter()
    with httpx.Client(trust_env=False, timeout=2.0) as h:
        while time.perf_counter() - start < timeout_s:
            workers = h.get(f"{router}/workers").json()["workers"]
            if next(w["is_healthy"] for w in workers if w["url"] == worker) == healthy:
                return time.perf_counter() - start
            time.sleep(0.1)
    raise AssertionError(f"{router} did not see {worker} {'up' if healthy else 'down'} "
                         f"within {timeout_s} s")


def _router(policy: str, port: int, reps: list[Replica], model: str, log: Path,
            extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *[r.url for r in reps], "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
            "--health-failure-threshold", "2", "--worker-startup-check-interval", "1",
            "--log-level", "debug", *extra]
    if policy == "kv_aware":
        for r in reps:
            argv += ["--kv-event-source", f"{r.url}={r.events}",
                     "--kv-event-replay-source", f"{r.url}={r.replay}"]
        argv += ["--kv-event-block-size", "16", "--kv-event-model", model]
    return subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=ENV)


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("replicas")
    base, port = _free_block(20), free_port()
    out = root / "replicas.out"
    proc = subprocess.Popen(
        [*CLI, "replicas", "--replicas", "2", "--run-dir", str(root), "--port", str(port),
         "--router-metrics-port", str(free_port()), "--replica-base-port", str(base),
         "--device-blocks", str(DEVICE_BLOCKS), "--host-blocks", str(HOST_BLOCKS),
         "--router-log-level", "debug", "--startup-timeout", "240"],
        stdout=out.open("wb"), stderr=subprocess.STDOUT, env=ENV)
    extra: list[subprocess.Popen[bytes]] = []
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", START_TIMEOUT_S, proc, out)
        reps = [Replica(f"replica-{i}", f"http://127.0.0.1:{base + 10 * i}", root / f"replica-{i}",
                        f"tcp://127.0.0.1:{base + 10 * i + 5}",
                        f"tcp://127.0.0.1:{base + 10 * i + 6}") for i in range(2)]
        with httpx.Client(trust_env=False) as h:
            model = h.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        ports = {"cache": free_port(), "device": free_port()}
        extra = [_router("cache_aware", ports["cache"], reps, model, root / "cache_aware.out"),
                 _router("kv_aware", ports["device"], reps, model, root / "device_only.out",
                         ("--kv-penalty-host", "0"))]
        for p in ports.values():  # (the kv_aware one replays the events it missed)
            _wait_http(f"http://127.0.0.1:{p}/health", 60)
        yield Deployment(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ports['cache']}",
                         f"http://127.0.0.1:{ports['device']}", root / "router.out", reps, model)
    finally:
        for p in [*extra, proc]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*extra, proc]:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _turn(url: str, messages: list[dict[str, str]], **kw: object) -> Turn:
    async with httpx.AsyncClient(trust_env=False, timeout=300) as c:
        return await chat(c, url, messages, **kw)  # type: ignore[arg-type]


def _fill_device(rep: Replica, seed: int) -> None:
    """One request that takes the replica's whole device pool (500 prompt tokens and one
    more: 32 blocks), so every cached block there is evicted; its SLOs keep LVF's
    iteration budget out of its way (the prompt in one chunk)."""
    rng = random.Random(seed)
    body = {"prompt": [rng.randrange(1000, 40000) for _ in range(DEVICE_BLOCKS * 16 - 12)],
            "max_tokens": 1, "slo": {"ttft_ms": 60_000, "tbt_ms": 10_000}}
    with httpx.Client(trust_env=False, timeout=120) as h:
        r = h.post(f"{rep.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text


def _filler(i: int, n_words: int = 75) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Filler {i} " + " ".join(
        f"w{(i * 7919 + k * 104729) % 9973}" for k in range(n_words))}]


# -- identity ---------------------------------------------------------------------------------
def test_request_id_slo_usage_and_streaming_pass_through_the_router(dep: Deployment) -> None:
    msgs = [{"role": "user", "content": "Name three rivers of Europe, briefly."}]
    via = _run(_turn(dep.router, msgs, max_tokens=12, request_id="router-id-1",
                     extra={"slo": {"ttft_ms": 4321, "tbt_ms": 234}}))
    assert via.ok, via.error
    assert via.request_id == "router-id-1"
    rep = dep.replica(via.replica)
    direct = _run(_turn(rep.url, msgs, max_tokens=12, request_id="router-id-2"))
    assert direct.ok
    # The same greedy stream, chunk by chunk, and the same usage (the direct one found the
    # prompt cached by the first).
    assert via.chunks == direct.chunks
    assert (via.prompt_tokens, via.completion_tokens) == (direct.prompt_tokens,
                                                          direct.completion_tokens)
    lines = [ln for ln in (rep.run_dir / "scheduler.log").read_text().splitlines()
             if '"router-id-1"' in ln and '"submit"' in ln]
    assert lines and '"ttft_slo": 4.321' in lines[0] and '"tbt_slo": 0.234' in lines[0], lines
    with httpx.Client(trust_env=False, timeout=60) as h:
        plain = h.post(f"{dep.router}/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            headers={"X-Request-ID": "router-id-3"})
    assert plain.status_code == 200 and plain.json()["id"].endswith("router-id-3")
    assert plain.json()["usage"]["completion_tokens"] == 4


def test_what_the_router_asks_a_replica(dep: Deployment) -> None:
    """Render (the ids the engine computes: kv_aware's input), vLLM's /tokenize (its
    fallback), and discovery's /get_server_info and /kv_event_sources."""
    a = dep.replicas[0]
    msgs = [{"role": "user", "content": "How are tokens counted?"}]
    with httpx.Client(trust_env=False, base_url=a.url, timeout=60) as h:
        ids = h.post("/v1/chat/completions/render", json={"messages": msgs}).json()["token_ids"]
        tok = h.post("/tokenize", json={"model": dep.model, "messages": msgs}).json()
        done = h.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}).json()
        assert tok["tokens"] == ids and tok["count"] == len(ids) == done["usage"]["prompt_tokens"]
        plain = h.post("/v1/completions/render", json={"prompt": "one two three"}).json()
        assert plain["token_ids"] == h.post("/tokenize", json={"prompt": "one two three"}).json()[
            "tokens"]
        bad = h.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})
        assert bad.status_code == 400 and "add_generation_prompt" in bad.text
        assert h.get("/get_server_info").json() == {
            "model_id": dep.model, "instance_id": a.name, "kv_block_size": 16,
            "max_model_len": DEVICE_BLOCKS * 16}
        assert h.get("/kv_event_sources").json() == {"0": {
            "endpoint": a.events, "replay_endpoint": a.replay, "topic": "", "publisher": "zmq",
            "encoding": "msgpack", "schema_version": 1, "enable_kv_cache_events": True}}


# -- locality, and what the host tier adds -----------------------------------------------------
def _host_hits(dep: Deployment) -> float:
    """Prompt tokens the replicas served from host memory so far (their /metrics)."""
    total = 0.0
    with httpx.Client(trust_env=False, timeout=10) as h:
        for r in dep.replicas:
            for line in h.get(f"{r.url}/metrics").text.splitlines():
                if line.startswith('superinfer_scheduler_prefix_cache_hits_tokens_total{tier="host"'):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def _sessions(url: str, seed: int) -> tuple[list[Session], list[Turn]]:
    """8 sessions of 4 turns: the first turns all at once (the router spreads them by
    load), then one request at a time, the sessions in turn, so that the router's choice
    rests on the prefix alone. By a session's next turn the seven others have pushed its
    blocks out of the 32-block device pool: its prefix lives in its replica's host memory
    only."""
    sessions = [Session(i, seed=seed) for i in range(8)]
    turns = _run(run_sessions(url, sessions, turns=1, concurrency=8))
    turns += _run(run_sessions(url, sessions, turns=3, concurrency=1))
    assert all(t.ok for t in turns), [t.error for t in turns if not t.ok]
    return sessions, turns


def test_kv_aware_keeps_sessions_on_the_replica_whose_host_memory_holds_them(
        dep: Deployment) -> None:
    before = _host_hits(dep)
    sessions, turns = _sessions(dep.router, seed=1)
    same, total = locality(sessions)
    assert total == 24 and same / total >= 0.9, [[t.replica for t in s.turns] for s in sessions]
    assert {t.replica for t in turns} == {"replica-0", "replica-1"}
    # The later turns found their history cached, in host memory.
    later = [t for s in sessions for t in s.turns[1:]]
    cached = sum(t.cached_tokens or 0 for t in later)
    assert cached > 0.5 * sum(t.prompt_tokens or 0 for t in later)
    assert _host_hits(dep) - before >= 0.7 * cached


def test_turns_whose_prefix_is_only_in_host_memory_follow_it_when_the_host_tier_counts(
        dep: Deployment) -> None:
    """Before each round of later turns a filler goes straight to each replica and pushes
    every cached block out of its device pool: each session's prefix lives in its
    replica's host memory only (a turn brings back its own prefix, no one else's).
    kv_aware crediting host blocks (the default 0.8) keeps the turn there; crediting them
    0, as a router that sees the device tier only, finds no prefix anywhere and leaves
    the turn to its tie-break."""
    def run(url: str, seed: int) -> float:
        sessions = [Session(i, seed=seed) for i in range(6)]
        _run(run_sessions(url, sessions, turns=1, concurrency=6))  # spread by load
        for t in range(2):
            with ThreadPoolExecutor(len(dep.replicas)) as pool:  # both replicas at once:
                list(pool.map(_fill_device, dep.replicas,  # no session's prefix on a device
                              [seed * 100 + 10 * t + k for k in range(len(dep.replicas))]))
            for s in sessions:
                msgs = s.next_messages()
                turn = _run(_turn(url, msgs, session=s.index, turn=t + 1))
                assert turn.ok, turn.error
                s.record(msgs, turn)
        same, total = locality(sessions)
        return same / total

    host = _host_hits(dep)
    both = run(dep.router, 2)
    served_from_host = _host_hits(dep) - host
    device_only = run(dep.device_only, 3)
    print(f"host-only prefixes: locality {both:.2f} with host blocks credited "
          f"({served_from_host:.0f} tokens from host memory), {device_only:.2f} without")
    assert both >= 0.9, both
    assert served_from_host >= 11 * 64  # those turns were served from host memory
    assert device_only <= 0.75, device_only


# -- what only events show --------------------------------------------------------------------
def test_after_a_scheduler_restart_kv_aware_moves_on_and_cache_aware_does_not(
        dep: Deployment) -> None:
    s = Session(0, seed=4)
    msgs0 = s.next_messages()
    first = _run(_turn(dep.cache_aware, msgs0))
    assert first.ok
    s.record(msgs0, first)
    holder, other = dep.replica(first.replica), dep.other(first.replica)
    # The holder's scheduler dies and comes back with no cached block (AllBlocksCleared).
    old = read_pid(holder.run_dir / "scheduler.pid")
    assert old is not None
    os.kill(old, signal.SIGKILL)
    _wait_restarted(holder, "scheduler", old)
    _wait_http(f"{holder.url}/health", 120)
    assert _replayed(holder.replay)[0] == [{"type": "AllBlocksCleared"}]
    # The other replica sees the session's first turn: now it holds the prefix.
    again = _run(_turn(other.url, msgs0))
    assert again.ok
    for router in (dep.router, dep.cache_aware):  # both routers route to the holder again
        _wait_router_sees(router, holder.url, True, 30)
    time.sleep(0.5)  # the other's events reach the routers
    msgs1 = s.next_messages()
    kv = _run(_turn(dep.router, msgs1))
    cache = _run(_turn(dep.cache_aware, msgs1))
    assert kv.ok and cache.ok
    print(f"after the restart: kv_aware -> {kv.replica} ({kv.cached_tokens} cached, TTFT "
          f"{kv.ttft_s:.2f} s), cache_aware -> {cache.replica} ({cache.cached_tokens} cached, "
          f"TTFT {cache.ttft_s:.2f} s)")
    assert kv.replica == other.name and (kv.cached_tokens or 0) >= 64
    assert cache.replica == holder.name  # its tree still says the holder
    assert (cache.cached_tokens or 0) < (kv.cached_tokens or 0)


def _wait_restarted(rep: Replica, service: str, old: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = read_pid(rep.run_dir / f"{service}.pid")
        if pid is not None and pid != old:
            return
        time.sleep(0.2)
    raise AssertionError(f"{rep.name}'s {service} did not come back")


def _replayed(endpoint: str, timeout_s: float = 10.0) -> list[list[dict[str, object]]]:
    """Every batch the publisher at `endpoint` (replay socket) still holds, from seq 0."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
        batches = []
        while True:
            frames = sock.recv_multipart()
            if int.from_bytes(frames[-2], "big", signed=True) == -1:
                return batches
            batches.append(msgpack.unpackb(frames[-1])[1])
    finally:
        sock.close()
        ctx.term()


# -- bad input --------------------------------------------------------------------------------
def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, env=ENV)


def _serve(*argv: str) -> subprocess.CompletedProcess[str]:
    """`superinfer serve` with a free port for every service but those `argv` gives."""
    given = set(argv)
    flags = [f for f in ("--port", "--scheduler-port", "--worker-port", "--kvmem-port")
             if f not in given]
    ports: list[int] = []
    while len(ports) < len(flags):  # free_port may hand out one just released twice
        p = free_port()
        if p not in ports:
            ports.append(p)
    free = [a for flag, p in zip(flags, ports, strict=True) for a in (flag, str(p))]
    return _cli("serve", "--grpc-port", "0", *free, *argv)


def test_bad_input_fails_at_once_naming_the_value_and_starts_nothing(
        dep: Deployment, tmp_path: Path) -> None:
    a = dep.replicas[0]
    port = a.url.rsplit(":", 1)[1]
    fresh = tmp_path / "second"
    # A second replica on the first's port.
    r = _serve("--run-dir", str(fresh), "--port", port)
    assert r.returncode == 2, r.stderr
    assert f"port {port} (--port" in r.stderr and "nothing was started" in r.stderr
    assert not fresh.exists()
    # ... on its KV events port.
    events_port = a.events.rsplit(":", 1)[1]
    r = _serve("--run-dir", str(fresh), "--kv-events-config",
               f'{{"endpoint": "tcp://*:{events_port}"}}')
    assert r.returncode == 2 and f"port {events_port} (--kv-events-config endpoint" in r.stderr
    # ... in the first's run dir.
    r = _serve("--run-dir", str(a.run_dir))
    assert r.returncode == 2 and f"run dir {a.run_dir} is in use" in r.stderr
    # A malformed events endpoint.
    for bad in ("tcp://*:99999", "localhost:5557", "tcp://*:"):
        r = _serve("--run-dir", str(fresh), "--kv-events-config", f'{{"endpoint": "{bad}"}}')
        assert r.returncode == 2 and repr(bad) in r.stderr, r.stderr
    r = _cli("scheduler", "--run-dir", str(fresh), "--kv-events-config", "{endpoint")
    assert r.returncode == 2 and "--kv-events-config is not JSON" in r.stderr
    # A router target that does not answer; replicas on ports in use.
    dead = f"http://127.0.0.1:{free_port()}"
    r = _cli("replicas", "--replicas", "0", "--worker-url", dead, "--run-dir", str(fresh),
             "--port", str(free_port()), "--router-metrics-port", str(free_port()))
    assert r.returncode == 2 and f"--worker-url {dead} is unreachable" in r.stderr
    r = _cli("replicas", "--run-dir", str(fresh), "--port", str(free_port()),
             "--router-metrics-port", str(free_port()), "--replica-base-port", port)
    assert r.returncode == 2 and f"port {port} (" in r.stderr and "nothing was started" in r.stderr
    assert not fresh.exists()
    # The first replica is untouched.
    ok = _run(_turn(a.url, [{"role": "user", "content": "Still there?"}], max_tokens=2))
    assert ok.ok and ok.replica == a.name


# -- kill -9 -----------------------------------------------------------------------------------
def _processes(rep: Replica) -> list[int]:
    """The replica's serve process and its four services."""
    pids = [read_pid(rep.run_dir / f"{s}.pid") for s in ("worker", "kvmem", "scheduler", "gateway")]
    services = [p for p in pids if p is not None]
    with open(f"/proc/{services[-1]}/stat") as f:
        serve = int(f.read().rsplit(")", 1)[1].split()[1])
    return [serve, *services]


def test_kill_9_of_a_whole_replica_under_load(dep: Deployment) -> None:
    y = Session(0, seed=5)
    msgs0 = y.next_messages()
    first = _run(_turn(dep.router, msgs0))
    assert first.ok
    y.record(msgs0, first)
    victim, survivor = dep.replica(first.replica), dep.other(first.replica)

    async def load() -> tuple[list[Turn], float]:
        async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
            # Long enough to outlast the sleep below on a fast CPU (with 200 tokens all had
            # ended within those 3 s, no stream left to cut); the 512-token pool bounds it.
            streams = [asyncio.create_task(chat(c, dep.router, _filler(900 + i, 20),
                                                max_tokens=320, ignore_eos=True))
                       for i in range(6)]
            await asyncio.sleep(3.0)  # every stream is under way (past its first bytes)
            pids = _processes(victim)
            killed = time.perf_counter()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            down = asyncio.create_task(_marked_down(c, dep.router, victim.url))
            return list(await asyncio.gather(*streams)), killed, await down

    streams, killed, down = _run(load())
    cut = [t for t in streams if t.replica == victim.name]
    assert cut, [t.replica for t in streams]
    for t in cut:  # each ended, incomplete, within 10 s of the kill
        assert not t.ok and t.ended_s is not None and t.ended_s - killed < 10.0, t
    print("cut streams:", [(t.error, round((t.ended_s or 0) - killed, 2)) for t in cut])
    assert all(t.ok for t in streams if t.replica == survivor.name)
    # Past the router's detection window (2 failed health checks, 1 s apart): every new
    # request is served, by the survivor.
    assert down - killed < 10.0, down - killed
    after = [_run(_turn(dep.router, _filler(950 + i, 20), max_tokens=2)) for i in range(4)]
    assert all(t.ok and t.replica == survivor.name for t in after), after
    # The replica comes back (`replicas` restarts it) and says it holds nothing.
    _wait_http(f"{victim.url}/health", 300)
    up_s = time.perf_counter() - killed
    assert _replayed(victim.replay)[0] == [{"type": "AllBlocksCleared"}]
    _wait_router_sees(dep.router, victim.url, True, 30)  # its health check sees it up again
    print(f"kill -9: the router marked the replica down {down - killed:.1f} s after the kill; it was "
          f"healthy again after {up_s:.1f} s, and in the router's view after "
          f"{time.perf_counter() - killed:.1f} s")
    # No request is routed on its stale blocks: the session's next turn finds no credit
    # with the restarted replica (the router's own decision).
    mark = len(kv_decisions(dep.router_log))
    msgs1 = y.next_messages()
    nxt = _run(_turn(dep.router, msgs1))
    assert nxt.ok
    worker, _, credit = kv_decisions(dep.router_log)[mark]
    assert not (worker == victim.url and credit > 0), (worker, credit)
    # ... and it is routed to again.
    seen = set()
    for i in range(6):
        pair = _run(_pair(dep.router, 960 + 2 * i))
        seen |= {t.replica for t in pair if t.ok}
        if victim.name in seen:
            break
    assert victim.name in seen


async def _marked_down(c: httpx.AsyncClient, router: str, worker: str) -> float:
    """When (perf_counter) the router's own view of `worker` (GET /workers) turned unhealthy."""
    deadline = time.perf_counter() + 30
    while time.perf_counter() < deadline:
        workers = (await c.get(f"{router}/workers")).json()["workers"]
        if not next(w["is_healthy"] for w in workers if w["url"] == worker):
            return time.perf_counter()
        await asyncio.sleep(0.1)
    raise AssertionError(f"{router} still routes to {worker} 30 s after it was killed")


async def _pair(url: str, i: int) -> list[Turn]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
        return list(await asyncio.gather(chat(c, url, _filler(i, 20), max_tokens=4),
                                         chat(c, url, _filler(i + 1, 20), max_tokens=4)))
