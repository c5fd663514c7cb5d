"""What every backend service process does the same way: one gRPC server on uvloop.

A `Daemon` supplies its servicers and a start/stop pair; `run_daemon` does the rest:
JSON logs in the run dir, a pid file, the standard gRPC health service (NOT_SERVING while
the daemon starts — loading a model takes seconds — then SERVING), and a clean stop on
SIGTERM/SIGINT so that shared memory and pid files never outlive the process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
from abc import ABC, abstractmethod
from pathlib import Path

import grpc
import structlog
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.logging import configure_logging

# Loopback channels and servers: never route through an HTTP proxy from the environment,
# and never share a port with another server (gRPC sets SO_REUSEPORT by default, which
# would let a second `superinfer worker` bind a busy port without an error).
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
STOP_GRACE_S = 2.0

log = structlog.get_logger()


class Daemon(ABC):
    name: str = "?"

    @abstractmethod
    def register(self, server: grpc.aio.Server) -> None:
        """Add this service's servicers (before the server starts)."""

    @abstractmethod
    async def start(self) -> None:
        """Slow initialisation (load a model, reach peers); SERVING once it returns."""

    @abstractmethod
    async def stop(self) -> None:
        """Release what start() took; called once, also after a failed start."""

    async def drain(self) -> None:
        """On SIGTERM, before the server stops: finish or cancel in-flight work.

        Health already says NOT_SERVING; the gRPC server still answers, so streams can
        deliver their last events. Nothing to do for a service whose calls are short.
        """
        return None


class PidFile:
    """`<run_dir>/<service>.pid`, refusing to start a second copy in the same run dir."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def acquire(self) -> None:
        other = read_pid(self.path)
        if other is not None and other != os.getpid() and pid_alive(other):
            raise RuntimeError(f"{self.path} names running process {other}; stop it first")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f"{os.getpid()}\n")

    def release(self) -> None:
        if read_pid(self.path) == os.getpid():
            self.path.unlink(missing_ok=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for tests and benchmarks).

    Chosen below the kernel's ephemeral range where there is room: a port the kernel hands
    out is also the next outgoing connection's, and one did take a gateway's port while
    the services started before it (seen in CI: "cannot listen ... port in use")."""
    low = _ephemeral_low()
    if low is not None and low > 11024:
        for _ in range(64):
            port = random.randrange(low - 10000, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int | None:
    """The first port of the kernel's range for outgoing connections (None: unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3 on of /proc/<pid>/stat (state, ppid, ...: after the command name, which may
    hold spaces and parentheses), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), or None if it is gone.

    A pid names a process only together with its start: in a container every restart of
    the service is pid 1 again.
    """
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None  # field 22, starttime
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (dead, not yet reaped by its parent) still answers signal 0.
    fields = _proc_stat(pid)
    return not fields or fields[0] != "Z"


def add_daemon_arguments(p: argparse.ArgumentParser, port: int) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port})")
    g.add_argument("--run-dir", default="./.superinfer", help="pid and log files go here")
    g.add_argument("--log-level", default="info", help="debug, info, warning, error")


def run_daemon(daemon: Daemon, args: argparse.Namespace) -> int:
    """Run `daemon` until SIGTERM/SIGINT; 0 on a clean stop, 1 if it failed to start."""
    run_dir = Path(args.run_dir)
    configure_logging(daemon.name, log_file=run_dir / f"{daemon.name}.log", level=args.log_level)
    pid = PidFile(run_dir / f"{daemon.name}.pid")
    try:
        pid.acquire()
    except RuntimeError as e:
        log.error("already_running", error=str(e))
        return 1
    try:
        return uvloop.run(_serve(daemon, f"{args.host}:{args.port}"))
    finally:
        pid.release()


async def _serve(daemon: Daemon, addr: str) -> int:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    status = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    daemon.register(server)
    try:
        server.add_insecure_port(addr)
    except RuntimeError as e:
        log.error("bind_failed", addr=addr, error=str(e))
        return 1
    await status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("listening", addr=addr, pid=os.getpid())

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    rc = 0
    starting = asyncio.create_task(daemon.start())
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        if starting.exception() is not None:
            log.error("start_failed", error=str(starting.exception()),
                      exc_info=starting.exception())
            rc = 1
        else:
            await status.set("", health_pb2.HealthCheckResponse.SERVING)
            log.info("serving")
            await stop_wait
    else:
        starting.cancel()  # a stop during start-up: the daemon's stop() tidies up
        await asyncio.gather(starting, return_exceptions=True)
    stop_wait.cancel()

    log.info("stopping")
    await status.enter_graceful_shutdown()
    if rc == 0 and starting.done() and not starting.cancelled():
        await daemon.drain()
    await server.stop(STOP_GRACE_S)
    await daemon.stop()
    log.info("stopped", rc=rc)
    return rc
