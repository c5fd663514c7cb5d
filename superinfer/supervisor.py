"""Starting, watching, restarting and stopping the service processes of `superinfer serve`.

One `Supervisor` owns the child processes. It starts them in dependency order and waits
until each says it is ready (gRPC health SERVING, or HTTP 200). `wait()` watches them:
with a `RestartPolicy` it restarts a child that dies, after an exponential backoff, and
gives up once a child died too often within a window; every step is a JSON log line.
With a liveness timeout it also kills (and so restarts) a child that stays alive but stops
answering its health check for that long: a hung or stopped process, which would otherwise
stall the others forever. The other services reconnect by themselves (DESIGN §6). A child
killed with SIGKILL leaves its pid file and, for the worker, its shared-memory segment
behind: the supervisor removes both. `stop_all()` stops the children in stages, SIGTERM
then SIGKILL after a timeout; children of one stage stop together, so that the
scheduler's drain can still end the gateway's streams with a clear error.
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

import structlog

from common.shm import SegmentRecord
from superinfer.probes import Probe

SUPERVISOR_ENV = "SUPERINFER_SUPERVISOR_PID"

log = structlog.get_logger()


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    probe: tuple[Probe, Callable[[], None]]
    pid_file: Path | None = None  # removed here if the child could not remove it itself
    # stop_all() stops higher stages first, a stage's children together; default: its
    # position in start order (the last started stops first).
    stop_stage: int | None = None
    # (answers at all?, close): checked while up when the supervisor has a liveness timeout.
    alive: tuple[Probe, Callable[[], None]] | None = None


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Restart a dead child after backoff_s, doubling up to max_backoff_s; give up when it
    died more than max_restarts times within window_s."""

    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("restart backoff must be >= 0 and at most its maximum")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and window_s positive")

    def delay(self, deaths: int) -> float:
        """Backoff before the restart that follows the `deaths`-th death in the window."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** max(0, deaths - 1))


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
    state: str = "up"  # "up", "backoff" (dead, restart due at `due`), "starting"
    due: float = 0.0  # backoff: when to restart; starting: readiness deadline
    started: float = field(default_factory=time.monotonic)
    deaths: list[float] = field(default_factory=list)  # monotonic times, within the window
    restarts: int = 0
    alive_at: float = field(default_factory=time.monotonic)  # last answered liveness check
    next_alive_check: float = 0.0
    killed_because: str | None = None  # why the supervisor killed it, for the exit log


def exit_reason(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Supervisor:
    run_dir: Path
    stop_timeout_s: float = 10.0
    # Kill a child that has not answered its liveness check for this long (0: never).
    liveness_timeout_s: float = 0.0
    liveness_interval_s: float = 2.0
    children: list[_Child] = field(default_factory=list)

    def _spawn(self, spec: ServiceSpec, out: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            spec.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            env={**os.environ, SUPERVISOR_ENV: str(os.getpid())},
        )

    def send_signal(self, name: str, signum: int) -> bool:
        """Pass `signum` to the running child `name` (SIGHUP: reload); False if none runs."""
        for child in self.children:
            if child.spec.name == name and child.proc.poll() is None:
                child.proc.send_signal(signum)
                return True
        return False

    def start(self, spec: ServiceSpec, timeout_s: float) -> None:
        """Start one service and wait until it is ready; ServiceFailed if it is not."""
        self.start_all([spec], timeout_s)

    def start_all(self, specs: list[ServiceSpec], timeout_s: float) -> None:
        """Start the services at once and wait until every one is ready (ServiceFailed
        naming the first that dies or is not ready in time). Each waits for its peers by
        itself (the scheduler for the worker and kvmem, the gateway's health for the
        scheduler), so their imports and the model load overlap instead of queueing."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        pending: list[_Child] = []
        for spec in specs:
            # The child's console (JSON log lines, and any traceback from before logging
            # was set up) goes to <name>.out; its JSON log proper is <name>.log.
            out_path = self.run_dir / f"{spec.name}.out"
            out = open(out_path, "ab")  # noqa: SIM115 - closed in stop_all
            child = _Child(spec, self._spawn(spec, out), out, out_path)
            self.children.append(child)
            pending.append(child)
        deadline = time.monotonic() + timeout_s
        while pending:
            for child in list(pending):
                code = child.proc.poll()
                if code is not None:
                    raise ServiceFailed(child.spec.name, f"{exit_reason(code)} while starting",
                                        self.tail(child))
                probe, _ = child.spec.probe
                if probe():
                    child.alive_at = time.monotonic()
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                child = pending[0]
                raise ServiceFailed(child.spec.name, f"not ready after {timeout_s:.0f} s",
                                    self.tail(child))
            if pending:
                time.sleep(0.2)

    def wait(
        self, poll_s: float = 0.5, restart: RestartPolicy | None = None,
        startup_timeout_s: float = 300.0,
    ) -> ServiceFailed:
        """Watch the children until one fails for good, and return which one.

        Without a restart policy the first death is final; with one, a dead child is
        restarted after its backoff and is final only past the policy's limit.
        """
        while True:
            for child in self.children:
                failed = self._watch(child, restart, startup_timeout_s)
                if failed is not None:
                    return failed
            time.sleep(poll_s)

    def _watch(
        self, child: _Child, policy: RestartPolicy | None, startup_timeout_s: float
    ) -> ServiceFailed | None:
        name, now = child.spec.name, time.monotonic()
        if child.state == "backoff":
            if now >= child.due:
                child.proc = self._spawn(child.spec, child.out)
                child.state, child.due, child.started = "starting", now + startup_timeout_s, now
                child.restarts += 1
                log.info("service_restarting", service=name, pid=child.proc.pid,
                         restart=child.restarts)
            return None
        code = child.proc.poll()
        if code is None:
            if child.state == "starting":
                if child.spec.probe[0]():
                    child.state, child.alive_at = "up", now
                    log.info("service_restarted", service=name, pid=child.proc.pid,
                             ready_s=round(now - child.started, 2), restart=child.restarts)
                elif now > child.due:
                    log.error("service_not_ready", service=name, pid=child.proc.pid,
                              timeout_s=startup_timeout_s)
                    child.proc.kill()  # counted as a death on the next look
            elif self.liveness_timeout_s > 0:
                self._check_alive(child, now)
            return None
        why = child.killed_because or exit_reason(code)
        child.killed_because = None
        self._cleanup_after(child)
        if policy is None:
            return ServiceFailed(name, why, self.tail(child))
        child.deaths = [t for t in child.deaths if now - t < policy.window_s] + [now]
        if len(child.deaths) > policy.max_restarts:
            log.error("service_gave_up", service=name, pid=child.proc.pid, reason=why,
                      deaths=len(child.deaths), window_s=policy.window_s)
            return ServiceFailed(
                name, f"{why}; it died {len(child.deaths)} times within "
                f"{policy.window_s:.0f} s (--max-restarts {policy.max_restarts}), giving up",
                self.tail(child))
        delay = policy.delay(len(child.deaths))
        log.warning("service_exited", service=name, pid=child.proc.pid, reason=why,
                    state=child.state, restart_in_s=round(delay, 2),
                    deaths_in_window=len(child.deaths))
        child.state, child.due = "backoff", now + delay
        return None

    def _check_alive(self, child: _Child, now: float) -> None:
        """Kill a child that stopped answering: its death then takes the restart path."""
        if child.spec.alive is None or now < child.next_alive_check:
            return
        child.next_alive_check = now + self.liveness_interval_s
        if child.spec.alive[0]():
            child.alive_at = time.monotonic()
            return
        silent = time.monotonic() - child.alive_at
        if silent < self.liveness_timeout_s:
            return
        log.error("service_unresponsive", service=child.spec.name, pid=child.proc.pid,
                  silent_s=round(silent, 1), timeout_s=self.liveness_timeout_s,
                  action="SIGKILL, then restart as after any death")
        child.killed_because = (f"stopped answering its health check for {silent:.0f} s "
                                f"(--liveness-timeout {self.liveness_timeout_s:g}); killed")
        child.proc.kill()

    def _cleanup_after(self, child: _Child) -> None:
        """What a child killed by a signal could not remove: pid file, shared memory."""
        pid = child.proc.pid
        if child.spec.pid_file is not None:
            _remove_stale_pid(child.spec.pid_file, pid)
        reaped = SegmentRecord(self.run_dir / f"{child.spec.name}.shm").reap(dead_pid=pid)
        # A tensor-parallel worker's other ranks (worker/tp.py) die with it; those already
        # gone (a record's own pid decides) are reaped here, the rest by the next worker.
        for record in sorted(self.run_dir.glob(f"{child.spec.name}.rank*.shm")):
            reaped += SegmentRecord(record).reap()
        if reaped:
            log.info("shm_reaped", service=child.spec.name, pid=pid, segments=reaped)

    def stop_all(self) -> None:
        """Stop the children, stage by stage: SIGTERM, wait, SIGKILL."""
        stages: dict[int, list[_Child]] = {}
        for i, child in enumerate(self.children):
            stage = child.spec.stop_stage if child.spec.stop_stage is not None else i
            stages.setdefault(stage, []).append(child)
        for stage in sorted(stages, reverse=True):
            group = stages[stage]
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for child in group:
                proc = child.proc
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("service_killed", service=child.spec.name, pid=proc.pid,
                                why=f"still running {self.stop_timeout_s:.0f} s after SIGTERM")
                    proc.kill()
                    proc.wait()
                child.out.close()
                child.spec.probe[1]()
                if child.spec.alive is not None:
                    child.spec.alive[1]()
                self._cleanup_after(child)
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
