"""Starting, watching and stopping the service processes of `superinfer serve`.

One `Supervisor` owns the child processes: it starts them in dependency order, waits
until each says it is ready (gRPC health SERVING, or HTTP 200), and stops them in
reverse order (SIGTERM, then SIGKILL after a timeout). Restart-with-backoff will hook
in at `wait()`, which already reports the child that died.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from superinfer.daemon import CHANNEL_OPTIONS

Probe = Callable[[], bool]
SUPERVISOR_ENV = "SUPERINFER_SUPERVISOR_PID"


def grpc_probe(addr: str) -> tuple[Probe, Callable[[], None]]:
    """(is it SERVING?, close) for the gRPC health service at `addr`."""
    channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(channel)

    def probe() -> bool:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return probe, channel.close


def http_probe(url: str) -> tuple[Probe, Callable[[], None]]:
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=1.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    return probe, lambda: None


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    probe: tuple[Probe, Callable[[], None]]
    pid_file: Path | None = None  # removed here if the child could not remove it itself


class ServiceFailed(RuntimeError):
    def __init__(self, name: str, why: str, tail: str) -> None:
        super().__init__(f"{name} {why}")
        self.name = name
        self.why = why
        self.tail = tail


@dataclass
class _Child:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    out_path: Path


@dataclass
class Supervisor:
    run_dir: Path
    stop_timeout_s: float = 10.0
    children: list[_Child] = field(default_factory=list)

    def start(self, spec: ServiceSpec, timeout_s: float) -> None:
        """Start one service and wait until it is ready; ServiceFailed if it is not."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The child's console (JSON log lines, and any traceback from before logging
        # was set up) goes to <name>.out; its JSON log proper is <name>.log.
        out_path = self.run_dir / f"{spec.name}.out"
        out = open(out_path, "ab")  # noqa: SIM115 - closed in stop_all
        proc = subprocess.Popen(
            spec.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            env={**os.environ, SUPERVISOR_ENV: str(os.getpid())},
        )
        child = _Child(spec, proc, out, out_path)
        self.children.append(child)
        probe, _ = spec.probe
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ServiceFailed(spec.name, f"exited with code {proc.returncode} while starting",
                                    self.tail(child))
            if probe():
                return
            if time.monotonic() > deadline:
                raise ServiceFailed(spec.name, f"not ready after {timeout_s:.0f} s",
                                    self.tail(child))
            time.sleep(0.2)

    def wait(self, poll_s: float = 0.5) -> ServiceFailed:
        """Block until a child exits; return which one (a restart policy would go here)."""
        while True:
            for child in self.children:
                if child.proc.poll() is not None:
                    return ServiceFailed(child.spec.name,
                                         f"exited with code {child.proc.returncode}",
                                         self.tail(child))
            time.sleep(poll_s)

    def stop_all(self) -> None:
        """Stop children in reverse start order: SIGTERM, wait, SIGKILL."""
        for child in reversed(self.children):
            proc = child.proc
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            child.out.close()
            child.spec.probe[1]()
            if child.spec.pid_file is not None:
                _remove_stale_pid(child.spec.pid_file, proc.pid)
        self.children.clear()

    def tail(self, child: _Child, lines: int = 20) -> str:
        child.out.flush()
        try:
            text = child.out_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _remove_stale_pid(path: Path, pid: int) -> None:
    """A SIGKILLed child leaves its pid file; remove it only if it is that child's."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text().strip()) == pid:
            path.unlink()


def die_with_supervisor() -> None:
    """In a child: exit (SIGTERM) when the supervisor dies, so no orphan keeps a port.

    Done by the child itself after exec (Linux PR_SET_PDEATHSIG), not by a preexec_fn,
    which is unsafe in a parent that has threads (gRPC's, in the tests).
    """
    parent = os.environ.get(SUPERVISOR_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        sys.exit("superinfer: the supervisor exited before this service started")
