"""Health probes of the services, and `superinfer health` (a container's health check).

Readiness (`grpc_probe`, `http_probe`: SERVING / 200) and liveness (`grpc_alive`,
`http_alive`: any answer) for the supervisor, and the one-shot command Docker runs every
few seconds in each container. That command must stay cheap: it imports grpc and httpx
only, never torch (importing torch took ~3 s of a 5 s health-check budget in a container
on 2 busy CPUs, and the checks timed out).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.daemon import CHANNEL_OPTIONS
from superinfer.argtypes import positive

HEALTH_HELP = "exit 0 if a service is ready (for container health checks)"

Probe = Callable[[], bool]
# Probe channels retry a refused connection within 0.1-1 s, not gRPC's default backoff
# (1 s growing to 120 s), which would hide a restarted service from its probes for minutes.
PROBE_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _grpc_health(addr: str, timeout_s: float) -> tuple[Callable[[], int | None], Callable[[], None]]:
    """(the health status at `addr`, or None when no answer came in `timeout_s`; close)."""
    channel = grpc.insecure_channel(addr, options=PROBE_CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(channel)

    def status() -> int | None:
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status)
        except grpc.RpcError:
            return None

    return status, channel.close


def _http_status(url: str, timeout_s: float) -> Callable[[], int | None]:
    """The HTTP status of GET `url`, or None when no answer came in `timeout_s`."""
    def status() -> int | None:
        try:
            return httpx.get(url, timeout=timeout_s, trust_env=False).status_code
        except httpx.HTTPError:
            return None

    return status


def grpc_probe(addr: str, timeout_s: float = 1.0) -> tuple[Probe, Callable[[], None]]:
    """(is it SERVING?, close) for the gRPC health service at `addr`: readiness."""
    status, close = _grpc_health(addr, timeout_s)
    return (lambda: status() == health_pb2.HealthCheckResponse.SERVING), close


def grpc_alive(addr: str, timeout_s: float = 2.0) -> tuple[Probe, Callable[[], None]]:
    """(does it answer its health check at all?, close): liveness, whatever the status.

    A service may say NOT_SERVING for a while (draining, waiting for a peer); only no
    answer within `timeout_s` means the process is not running its event loop."""
    status, close = _grpc_health(addr, timeout_s)
    return (lambda: status() is not None), close


def http_probe(url: str, timeout_s: float = 1.0) -> tuple[Probe, Callable[[], None]]:
    """(does GET `url` answer 200?, close): readiness over HTTP (the gateway's /health)."""
    status = _http_status(url, timeout_s)
    return (lambda: status() == 200), lambda: None


def http_alive(url: str, timeout_s: float = 2.0) -> tuple[Probe, Callable[[], None]]:
    """Liveness over HTTP (the gateway's /livez): any response within `timeout_s`."""
    status = _http_status(url, timeout_s)
    return (lambda: status() is not None), lambda: None


def add_health_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("addr", help="host:port of a gRPC service, or an http:// URL such as "
                                "http://127.0.0.1:8000/health")
    p.add_argument("--timeout", type=positive(float), default=3.0,
                   help="seconds to wait for the answer (3; keep it under the container "
                        "health check's own timeout)")


def run_health(args: argparse.Namespace) -> int:
    """Exit 0 when the service at `addr` is ready: gRPC health SERVING, or HTTP 200."""
    if args.addr.startswith(("http://", "https://")):
        probe, close = http_probe(args.addr, args.timeout)
    else:
        probe, close = grpc_probe(args.addr, args.timeout)
    try:
        ok = probe()
    finally:
        close()
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


def health_main(argv: list[str]) -> int:
    """`superinfer health ...` without building the full CLI (which imports torch)."""
    p = argparse.ArgumentParser(prog="superinfer health", description=HEALTH_HELP)
    add_health_arguments(p)
    return run_health(p.parse_args(argv))
