"""Before `serve` (or `replicas`) starts anything: is every port it will bind free, and is
its run directory its own?

Several replicas share a host (DESIGN §9). A second one started on the first's ports must
fail at once, naming the port, and leave the first untouched: checked here, before any
child exists, instead of each child failing to bind and being restarted until the
supervisor gives up.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from common.daemon import pid_alive, read_pid

SERVICES = ("worker", "kvmem", "scheduler", "gateway")


@dataclass(frozen=True, slots=True)
class Port:
    """A port a process will listen on: which flag names it, on which address."""

    flag: str
    host: str
    port: int


def bind_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now, or None. SO_REUSEADDR as the servers set
    it, so a port whose last connections linger in TIME_WAIT counts as free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "is in use"
            if e.errno == errno.EADDRNOTAVAIL:
                return "is on an address this machine does not have"
            if e.errno == errno.EACCES:
                return "needs privileges (a port below 1024)"
            return f"cannot be bound ({e.strerror})"
    return None


def port_problem(ports: list[Port]) -> str | None:
    """The first port that is out of range, named twice, or not free; None when all are
    fine. The message names the flag, the address and the port."""
    seen: dict[int, Port] = {}
    for p in ports:
        if not 1 <= p.port <= 65535:
            return f"{p.flag} {p.port} is not a port (1-65535)"
        other = seen.get(p.port)
        if other is not None:
            return f"{other.flag} and {p.flag} both name port {p.port}; give each its own"
        seen[p.port] = p
    for p in ports:
        why = bind_problem(p.host, p.port)
        if why is not None:
            return (f"port {p.port} ({p.flag}, on {p.host}) {why}: another replica or program "
                    f"listens there; give {p.flag} a free port")
    return None


def run_dir_problem(run_dir: Path, services: tuple[str, ...] = SERVICES) -> str | None:
    """A live process named by a pid file of `run_dir`: another serve uses it."""
    for name in services:
        path = run_dir / f"{name}.pid"
        pid = read_pid(path)
        if pid is not None and pid_alive(pid):
            return (f"run dir {run_dir} is in use: {path} names running process {pid}; give "
                    "each replica its own --run-dir")
    return None
