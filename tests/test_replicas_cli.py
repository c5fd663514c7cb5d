"""`superinfer replicas` and `serve`'s start-up checks, without starting anything: what
each replica and the router are given, and the errors that stop them before a process
exists (the running deployment is tests/test_router.py)."""

from __future__ import annotations

import socket
from pathlib import Path

from common.kv_events import parse_kv_events_config
from superinfer.cli import build_parser
from superinfer.replicas import check, replica_spec, replicas_of, router_argv


def _args(tmp_path: Path, *argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["replicas", "--run-dir", str(tmp_path), *argv])


def test_serve_flags_reach_every_replica_and_each_gets_its_own_ports(tmp_path: Path) -> None:
    args = _args(tmp_path, "--replicas", "3", "--replica-base-port", "20100", "--policy", "fcfs",
                 "--device-blocks", "64")
    reps = replicas_of(args)
    seen: set[int] = set()
    for i, rep in enumerate(reps):
        argv = replica_spec(rep, args).argv
        assert argv[3] == "serve" and "--policy" in argv and argv[argv.index("--policy") + 1] == "fcfs"
        assert argv[argv.index("--device-blocks") + 1] == "64"
        assert argv[argv.index("--run-dir") + 1] == str(tmp_path / f"replica-{i}")
        assert argv[argv.index("--replica-id") + 1] == f"replica-{i}"
        ports = {int(argv[argv.index(f) + 1]) for f in
                 ("--port", "--grpc-port", "--scheduler-port", "--worker-port", "--kvmem-port")}
        events = parse_kv_events_config(argv[argv.index("--kv-events-config") + 1])
        assert events is not None and events.replay_endpoint is not None
        ports |= {events.endpoint.port, events.replay_endpoint.port}
        assert len(ports) == 7 and not ports & seen and min(ports) == 20100 + 10 * i
        seen |= ports
    router = router_argv(args, reps, "m")
    assert router[router.index("--policy") + 1] == "kv_aware"
    for rep in reps:
        assert rep.url in router
        assert f"{rep.url}={rep.events}" in router and f"{rep.url}={rep.replay}" in router
    assert router[router.index("--kv-event-model") + 1] == "m"
    plain = router_argv(_args(tmp_path, "--router-policy", "round_robin"), reps, "m")
    assert "--kv-event-source" not in plain


def test_a_busy_port_or_a_missing_router_stops_everything_before_it_starts(
        tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        problem = check(_args(tmp_path, "--port", str(busy)))
        assert problem is not None and problem.startswith(f"port {busy} (--port, on 127.0.0.1)")
        problem = check(_args(tmp_path, "--replica-base-port", str(busy - 3)))
        assert problem is not None and f"port {busy} (replica-0's port {busy}" in problem
    problem = check(_args(tmp_path, "--router-bin", str(tmp_path / "nowhere")))
    assert problem is not None and "nowhere" in problem and "not found" in problem
    problem = check(_args(tmp_path, "--replicas", "0"))
    assert problem is not None and "--replicas 0" in problem
    assert not any(tmp_path.iterdir())  # nothing written
