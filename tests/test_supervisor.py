"""The supervisor's restart policy and the shared-memory reaper, with small real processes.

(`tests/test_recovery.py` kills the real services under `superinfer serve`.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from common.daemon import pid_alive
from common.shm import SegmentRecord
from superinfer.supervisor import RestartPolicy, ServiceSpec, Supervisor, exit_reason

ALWAYS_READY = (lambda: True, lambda: None)


@pytest.fixture(autouse=True)
def _default_logging() -> None:
    """structlog as a fresh process has it: a test that configured logging before, in this
    pytest worker, may have set a level above info, and capture_logs would see nothing."""
    structlog.reset_defaults()


def _spec(name: str, code: str, run_dir: Path) -> ServiceSpec:
    return ServiceSpec(name, [sys.executable, "-c", code], ALWAYS_READY, run_dir / f"{name}.pid")


def test_backoff_doubles_up_to_its_cap() -> None:
    p = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [p.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)


def test_a_dying_service_is_restarted_then_given_up(tmp_path: Path) -> None:
    # Dies 0.3 s after each start: restarted twice, then the third death is final.
    sup = Supervisor(tmp_path)
    sup.start(_spec("flaky", "import time, sys; time.sleep(0.3); sys.exit(3)", tmp_path), 10)
    first = sup.children[0].proc.pid
    with structlog.testing.capture_logs() as logs:
        failed = sup.wait(poll_s=0.02, restart=RestartPolicy(backoff_s=0.05, max_restarts=2))
    sup.stop_all()
    assert failed.name == "flaky"
    assert "exited with code 3" in failed.why and "died 3 times" in failed.why
    assert "giving up" in failed.why and "--max-restarts 2" in failed.why
    events = [(e["event"], e.get("service")) for e in logs]
    assert events.count(("service_exited", "flaky")) == 2
    assert events.count(("service_restarting", "flaky")) == 2
    assert events.count(("service_restarted", "flaky")) == 2
    assert events[-1] == ("service_gave_up", "flaky")
    delays = [e["restart_in_s"] for e in logs if e["event"] == "service_exited"]
    assert delays == [0.05, 0.1]  # exponential backoff
    pids = [e["pid"] for e in logs if e["event"] == "service_restarting"]
    assert first not in pids and len(set(pids)) == 2


def test_without_a_policy_the_first_death_is_final(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    sup.start(_spec("sleeper", "import time; time.sleep(60)", tmp_path), 10)
    pid = sup.children[0].proc.pid
    (tmp_path / "sleeper.pid").write_text(f"{pid}\n")  # as a daemon would
    os.kill(pid, signal.SIGKILL)
    failed = sup.wait(poll_s=0.02)
    assert failed.why == "killed by SIGKILL"
    assert not (tmp_path / "sleeper.pid").exists()  # the stale pid file is removed
    sup.stop_all()


def test_stop_all_stops_a_stage_together_and_kills_stragglers(tmp_path: Path) -> None:
    """Later stages first; a stage's children get SIGTERM together and share one timeout,
    then SIGKILL; a child that exits on SIGTERM is never killed."""
    sup = Supervisor(tmp_path, stop_timeout_s=1.5)
    for name, ignore in (("polite", False), ("a", True), ("b", True)):
        ready = tmp_path / f"{name}.ready"
        # Ready (the supervisor's own readiness probe) only once its handler is in place.
        handler = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignore else ""
        code = (f"import pathlib, signal, time; {handler}"
                f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
        spec = ServiceSpec(name, [sys.executable, "-c", code],
                           (ready.exists, lambda: None), tmp_path / f"{name}.pid")
        spec.stop_stage = 1 if ignore else 0
        sup.start(spec, 60)
    procs = {c.spec.name: c.proc for c in sup.children}
    sent: list[tuple[str, int, float]] = []  # (service, signal, when), as the children get them
    for c in sup.children:
        def record(sig: int, name: str = c.spec.name,
                   send: Callable[[int], None] = c.proc.send_signal) -> None:
            sent.append((name, sig, time.monotonic()))
            send(sig)
        c.proc.send_signal = record  # type: ignore[method-assign]  # Popen.kill sends through it
    sup.stop_all()
    # a and b got SIGTERM before either was killed; they ignore it, so both were killed;
    # polite, in the earlier stage, was asked last and exited on SIGTERM alone.
    assert [(n, s) for n, s, _ in sent] == [("a", signal.SIGTERM), ("b", signal.SIGTERM),
                                            ("a", signal.SIGKILL), ("b", signal.SIGKILL),
                                            ("polite", signal.SIGTERM)]
    assert {n: p.returncode for n, p in procs.items()} == {
        "polite": -signal.SIGTERM, "a": -signal.SIGKILL, "b": -signal.SIGKILL}
    (_, _, term_a), _, (_, _, kill_a), (_, _, kill_b), _ = sent
    assert kill_a - term_a >= sup.stop_timeout_s  # the stage got its timeout ...
    assert kill_b - kill_a < sup.stop_timeout_s  # ... once: b did not wait a second one
    assert exit_reason(-9) == "killed by SIGKILL" and exit_reason(2) == "exited with code 2"


# A process that makes a segment the way the worker does, records it, and waits to be
# killed. Its resource tracker is told to forget the segment, so that only the reaper
# can remove it (as when the tracker dies too, e.g. the whole process group is killed).
_MAKER = """
import sys, time
from multiprocessing import resource_tracker
from pathlib import Path
from common.shm import SegmentRecord, SharedTensor
import torch
t = SharedTensor.create((4, 1024), torch.float32, prefix="si-kv-test")
resource_tracker.unregister("/" + t.name, "shared_memory")
SegmentRecord(Path(sys.argv[1])).add(t.name)
print(t.name, flush=True)
time.sleep(60)
"""


def test_reaper_unlinks_a_killed_workers_segment_and_spares_a_live_one(tmp_path: Path) -> None:
    record = tmp_path / "worker.shm"
    proc = subprocess.Popen([sys.executable, "-c", _MAKER, str(record)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith("si-kv-test-") and os.path.exists(f"/dev/shm/{name}")
        assert SegmentRecord(record).reap() == []  # its owner lives: hands off
        assert SegmentRecord(record).reap(dead_pid=proc.pid) == []
        proc.kill()
        proc.wait()
        assert not pid_alive(proc.pid)
        assert os.path.exists(f"/dev/shm/{name}")  # kill -9 leaves it behind
        assert SegmentRecord(record).reap(dead_pid=proc.pid + 1) == []  # someone else's
        assert SegmentRecord(record).reap(dead_pid=proc.pid) == [name]
        assert not os.path.exists(f"/dev/shm/{name}") and not record.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _health_server(port: int, status: str, freeze_after_s: float | None = None) -> str:
    """A real gRPC health service (as every service has) reporting `status`; with
    `freeze_after_s` it then SIGSTOPs itself: alive to the kernel, silent to clients."""
    code = (
        "import grpc, os, signal, time\n"
        "from concurrent import futures\n"
        "from grpc_health.v1 import health, health_pb2, health_pb2_grpc\n"
        "server = grpc.server(futures.ThreadPoolExecutor(2))\n"
        "h = health.HealthServicer()\n"
        "health_pb2_grpc.add_HealthServicer_to_server(h, server)\n"
        f"server.add_insecure_port('127.0.0.1:{port}')\n"
        "server.start()\n"
        f"h.set('', health_pb2.HealthCheckResponse.{status})\n"
    )
    if freeze_after_s is not None:
        code += f"time.sleep({freeze_after_s})\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    return code + "server.wait_for_termination()\n"


def _grpc_service(name: str, code_for_port: Callable[[int], str], timeout_s: float = 0.3) -> ServiceSpec:
    from common.daemon import free_port
    from superinfer.probes import grpc_alive, grpc_probe

    port = free_port()
    addr = f"127.0.0.1:{port}"
    return ServiceSpec(name, [sys.executable, "-c", code_for_port(port)], grpc_probe(addr),
                       alive=grpc_alive(addr, timeout_s=timeout_s))


def test_a_stopped_service_is_killed_and_restarted(tmp_path: Path) -> None:
    """SIGSTOP (or a hang) leaves the process alive but silent: liveness catches it."""
    spec = _grpc_service("frozen", lambda port: _health_server(port, "SERVING", freeze_after_s=2.0))
    sup = Supervisor(tmp_path, liveness_timeout_s=1.0, liveness_interval_s=0.1)
    sup.start(spec, 30)
    first = sup.children[0].proc
    try:
        with structlog.testing.capture_logs() as logs:
            failed = sup.wait(poll_s=0.05, restart=RestartPolicy(backoff_s=0.05, max_restarts=1))
        events = [e["event"] for e in logs]
        # Frozen, killed, restarted, frozen again, killed again: past max_restarts 1.
        assert events.count("service_unresponsive") == 2
        assert events.count("service_restarted") == 1
        exited = next(e for e in logs if e["event"] == "service_exited")
        assert "stopped answering its health check" in exited["reason"]
        assert first.returncode == -signal.SIGKILL
        assert failed.name == "frozen" and "stopped answering" in failed.why
        assert "giving up" in failed.why
    finally:
        sup.stop_all()


def test_a_not_serving_service_is_alive(tmp_path: Path) -> None:
    """NOT_SERVING (draining, waiting for a peer) is an answer: never killed for it."""
    # Silent for 1 s would kill it; the timer keeps the watch going three times as long.
    # Each health check may take 2 s to answer, so a slow machine is not silence.
    sup = Supervisor(tmp_path, liveness_timeout_s=1.0, liveness_interval_s=0.05)
    busy = _grpc_service("busy", lambda port: _health_server(port, "NOT_SERVING"),
                         timeout_s=2.0)
    assert busy.alive is not None
    busy.probe = busy.alive  # ready once it answers: its health says NOT_SERVING throughout
    sup.start(busy, 30)
    sup.start(_spec("timer", "import time; time.sleep(3.0)", tmp_path), 10)
    with structlog.testing.capture_logs() as logs:
        failed = sup.wait(poll_s=0.05)  # returns when the timer exits
    try:
        assert failed.name == "timer"
        assert sup.children[0].proc.poll() is None
        assert not [e for e in logs if e["event"] == "service_unresponsive"]
    finally:
        sup.stop_all()


def test_reaper_tells_a_restarted_service_from_the_one_with_its_pid(tmp_path: Path) -> None:
    """In a container every restart of the worker is pid 1: a record that names this pid
    but another start time is a dead predecessor's, and its segments must go."""
    record = tmp_path / "worker.shm"
    proc = subprocess.Popen([sys.executable, "-c", _MAKER, str(record)],
                            stdout=subprocess.PIPE, text=True)
    name = ""
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        data = json.loads(record.read_text())
        assert data["pid"] == proc.pid and data["start"] is not None
        proc.kill()
        proc.wait()
        # The predecessor had our pid: same record, pid rewritten to ours.
        record.write_text(json.dumps({**data, "pid": os.getpid()}))
        SegmentRecord(record).remove(name)  # not ours to drop from the record
        assert SegmentRecord(record).reap() == [name]
        assert not os.path.exists(f"/dev/shm/{name}") and not record.exists()
        # And this process's own record is never reaped, by itself or anyone.
        SegmentRecord(record).add("si-kv-test-mine")
        assert SegmentRecord(record).reap() == []
        assert json.loads(record.read_text())["segments"] == ["si-kv-test-mine"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if name:  # a failed assertion must not leave the segment in /dev/shm
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize(("status", "rc"), [("SERVING", 0), ("NOT_SERVING", 1)])
def test_health_command_exit_status(status: str, rc: int) -> None:
    """`superinfer health` (the containers' health check) against a real health service."""
    from common.daemon import free_port
    from superinfer.probes import grpc_alive

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _health_server(port, status)])
    alive, close = grpc_alive(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while not alive():
            assert time.monotonic() < deadline, "the health server did not start"
            time.sleep(0.05)
        out = subprocess.run([sys.executable, "-m", "superinfer.cli", "health",
                              f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (rc, status)
    finally:
        close()
        server.kill()
        server.wait()


def test_free_port_is_bindable_and_outside_the_outgoing_connections_range() -> None:
    """Ports for the services come from below the kernel's ephemeral range, where no
    outgoing connection takes them before the service binds (a gateway's did, in CI)."""
    import socket

    from common.daemon import _ephemeral_low, free_port

    low = _ephemeral_low()
    for _ in range(10):
        port = free_port()
        if low is not None and low > 11024:
            assert low - 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
