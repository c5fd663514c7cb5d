"""`superinfer replicas`: N replicas and vLLM's router in front of them, on this machine.

SuperInfer grows no router of its own (DESIGN §9): this command starts N `superinfer
serve` replicas, each on its own ports and run directory and publishing its KV events
(`--kv-events-config`), waits until they answer, then starts `vllm-router` (the PyPI
package) on `--port` with every replica as a worker and, for `--router-policy kv_aware`,
every replica's event sockets as its KV event sources. Every other flag is `serve`'s and
reaches each replica as given (`--policy`, `--device-blocks`, ...). A replica or the
router that dies is restarted, as `serve` restarts a service.

Before anything starts, every port (the router's, its metrics', and each replica's seven)
is checked, each run directory too, the router's program is found, and every `--worker-url`
(a replica started elsewhere, added to the router) must answer: otherwise a clear error
names the value and nothing is started.

Replica i listens on `--replica-base-port + 10 i` (REST) and the six ports after it:
client gRPC, scheduler, worker, kvmem, KV events, KV events replay.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from common.kv_events import KVEventsConfig, parse_endpoint
from superinfer.ports import Port, port_problem
from superinfer.probes import http_alive, http_probe
from superinfer.services_cli import _add_serve, _argv_for, check_serve
from superinfer.supervisor import RestartPolicy, ServiceFailed, ServiceSpec, Supervisor

ROUTER_POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware", "random",
                   "consistent_hash")
# Set per replica by this command, so not offered as flags (the rest of serve's are).
_PER_REPLICA = frozenset({"host", "port", "grpc_port", "scheduler_port", "worker_port",
                          "kvmem_port", "run_dir", "replica_id", "kv_events_config"})
PORTS_PER_REPLICA = 10
READY_TIMEOUT_S = 30.0  # the router, once the replicas are up


@dataclass(frozen=True, slots=True)
class Replica:
    index: int
    base_port: int
    run_dir: Path

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    def port(self, offset: int) -> int:
        return self.base_port + offset

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port(0)}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.port(5)}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.port(6)}"

    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig(parse_endpoint(self.events, "endpoint"),
                              parse_endpoint(self.replay, "replay_endpoint"))

    def serve_values(self, args: argparse.Namespace) -> dict[str, object]:
        """serve's flags for this replica: the command's own, its ports, its run dir."""
        return {**vars(args), "host": "127.0.0.1", "port": self.port(0),
                "grpc_port": self.port(1), "scheduler_port": self.port(2),
                "worker_port": self.port(3), "kvmem_port": self.port(4),
                "run_dir": str(self.run_dir), "replica_id": self.name,
                "kv_events_config": self.kv_events().to_json()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("router (vllm-router)")
    r.add_argument("--replicas", type=int, default=2, help="replicas to start (default 2)")
    r.add_argument("--router-policy", default="kv_aware", choices=ROUTER_POLICIES,
                   help="vllm-router's --policy (kv_aware: by the replicas' KV events)")
    r.add_argument("--host", default="127.0.0.1", help="the router's listen address")
    r.add_argument("--port", type=int, default=8000, help="the router's port (clients use it)")
    r.add_argument("--router-metrics-port", type=int, default=29000,
                   help="the router's Prometheus port")
    r.add_argument("--replica-base-port", type=int, default=8100,
                   help=f"replica i uses this + {PORTS_PER_REPLICA} i and the next six ports")
    r.add_argument("--worker-url", action="append", default=[], metavar="URL",
                   help="also route to a replica started elsewhere (repeatable); its KV "
                        "event sockets are found through its /kv_event_sources")
    r.add_argument("--kv-penalty-host", type=float, default=None,
                   help="kv_aware's credit for a prefix block in host memory (router "
                        "default 0.8)")
    r.add_argument("--health-check-interval", type=int, default=1,
                   help="seconds between the router's health checks of each replica")
    r.add_argument("--health-failure-threshold", type=int, default=2,
                   help="failed checks before the router stops sending to a replica")
    r.add_argument("--router-bin", default=None,
                   help="the vllm-router program (default: beside this Python, else PATH)")
    r.add_argument("--router-log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    # serve's flags but the per-replica ones, in serve's own groups.
    scratch = argparse.ArgumentParser(add_help=False)
    _add_serve(scratch)
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for g in scratch._action_groups:
        for action in g._group_actions:
            if action.dest in _PER_REPLICA or action.dest == "help":
                continue
            if g.title not in groups:
                groups[g.title] = p.add_argument_group(f"each replica: {g.title}")
            groups[g.title]._add_action(action)
    p.add_argument("--run-dir", default="./.superinfer-replicas",
                   help="replica i's run dir is RUN_DIR/replica-i; the router's log goes here")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replicas", help="run N replicas (serve) behind vLLM's router "
                       "(vllm-router), on this machine")
    add_arguments(p)
    p.set_defaults(func=run)


def replicas_of(args: argparse.Namespace) -> list[Replica]:
    root = Path(args.run_dir)
    return [Replica(i, args.replica_base_port + PORTS_PER_REPLICA * i, root / f"replica-{i}")
            for i in range(args.replicas)]


def router_program(args: argparse.Namespace) -> str | None:
    if args.router_bin:
        return args.router_bin if Path(args.router_bin).is_file() else None
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.is_file() else shutil.which("vllm-router")


def check(args: argparse.Namespace) -> str | None:
    """What stops the command before it starts anything (the message names the value)."""
    if args.replicas < 0 or (args.replicas == 0 and not args.worker_url):
        return f"--replicas {args.replicas}: start at least one, or give --worker-url"
    if router_program(args) is None:
        return (f"the router program {args.router_bin or 'vllm-router'!r} was not found; "
                "pip install vllm-router==0.1.17, or give --router-bin")
    ports = [Port("--port", args.host, args.port),
             Port("--router-metrics-port", "127.0.0.1", args.router_metrics_port)]
    for rep in replicas_of(args):
        # serve's own checks (ports apart: all replicas' together with the router's below)
        problem = check_serve(argparse.Namespace(**rep.serve_values(args)), ports_too=False)
        if problem:
            return problem
        ports += [Port(f"{rep.name}'s port {rep.port(k)} (--replica-base-port "
                       f"{args.replica_base_port} + {rep.index * PORTS_PER_REPLICA + k})",
                       "127.0.0.1", rep.port(k)) for k in range(7)]
    return port_problem(ports) or _unreachable(args.worker_url)


def _unreachable(urls: list[str]) -> str | None:
    import httpx  # here: `superinfer --help` and the services need not load it

    for url in urls:
        if not url.startswith(("http://", "https://")):
            return f"--worker-url {url!r} is not an http:// or https:// URL"
        try:
            with httpx.Client(trust_env=False, timeout=5.0) as c:
                r = c.get(f"{url.rstrip('/')}/health")
        except httpx.HTTPError as e:
            return (f"--worker-url {url} is unreachable ({type(e).__name__}: {e}); start that "
                    "replica first or fix the URL")
        if r.status_code != 200:
            return f"--worker-url {url} answered /health with {r.status_code}, not 200"
    return None


def replica_spec(rep: Replica, args: argparse.Namespace) -> ServiceSpec:
    argv = [sys.executable, "-m", "superinfer.cli", "serve",
            *_argv_for(_add_serve, rep.serve_values(args))]
    return ServiceSpec(rep.name, argv, http_probe(f"{rep.url}/health"), stop_stage=0,
                       alive=http_alive(f"{rep.url}/livez"))


def router_argv(args: argparse.Namespace, reps: list[Replica], model: str) -> list[str]:
    program = router_program(args)
    assert program is not None  # check() found it
    urls = [r.url for r in reps] + [u.rstrip("/") for u in args.worker_url]
    argv = [program, "--host", args.host, "--port", str(args.port),
            "--policy", args.router_policy, "--worker-urls", *urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(args.router_metrics_port),
            "--health-check-interval-secs", str(args.health_check_interval),
            "--health-failure-threshold", str(args.health_failure_threshold),
            "--worker-startup-check-interval", "1", "--log-level", args.router_log_level]
    if args.router_policy == "kv_aware":
        # The replicas started here: their sockets named outright (--worker-url ones are
        # found by the router through /kv_event_sources).
        for r in reps:
            argv += ["--kv-event-source", f"{r.url}={r.events}",
                     "--kv-event-replay-source", f"{r.url}={r.replay}"]
        argv += ["--kv-event-block-size", str(args.block_size), "--kv-event-model", model]
        if args.kv_penalty_host is not None:
            argv += ["--kv-penalty-host", str(args.kv_penalty_host)]
    return argv


def served_model(url: str) -> str:
    import httpx

    with httpx.Client(trust_env=False, timeout=10.0) as c:
        return str(c.get(f"{url}/v1/models").json()["data"][0]["id"])


class _Terminate(Exception):
    pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminate


def run(args: argparse.Namespace) -> int:
    problem = check(args)
    if problem:
        print(f"superinfer replicas: error: {problem}; nothing was started", file=sys.stderr)
        return 2
    from common.logging import configure_logging

    root = Path(args.run_dir)
    configure_logging("replicas", root / "replicas.log", args.log_level)
    reps = replicas_of(args)
    sup = Supervisor(root, stop_timeout_s=args.shutdown_grace + 20.0,
                     liveness_timeout_s=args.liveness_timeout)
    policy = RestartPolicy(backoff_s=args.restart_backoff,
                           max_backoff_s=max(10.0, args.restart_backoff),
                           max_restarts=args.max_restarts, window_s=args.restart_window)
    signal.signal(signal.SIGTERM, _on_sigterm)
    rc = 0
    try:
        for rep in reps:  # one at a time: two model loads at once only slow both down
            print(f"starting {rep.name} on {rep.url} …", file=sys.stderr, flush=True)
            sup.start(replica_spec(rep, args), args.startup_timeout + 60.0)
        model = served_model(reps[0].url if reps else args.worker_url[0].rstrip("/"))
        router = ServiceSpec("router", router_argv(args, reps, model),
                             http_probe(f"http://{_probe_host(args.host)}:{args.port}/health"),
                             stop_stage=1)
        print(f"starting vllm-router ({args.router_policy}) on {args.host}:{args.port} …",
              file=sys.stderr, flush=True)
        sup.start(router, READY_TIMEOUT_S)
        _print_ready(args, reps, model)
        failed = sup.wait(poll_s=0.2, restart=policy if args.max_restarts else None,
                          startup_timeout_s=args.startup_timeout + 60.0)
        print(f"superinfer replicas: {failed.name} {failed.why}; stopping the others\n"
              f"{failed.tail}", file=sys.stderr)
        rc = 1
    except ServiceFailed as e:
        print(f"superinfer replicas: {e.name} {e.why}; stopping the others\n{e.tail}",
              file=sys.stderr)
        rc = 1
    except (KeyboardInterrupt, _Terminate):
        print("stopping …", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all()
    return rc


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _print_ready(args: argparse.Namespace, reps: list[Replica], model: str) -> None:
    lines = [f"SuperInfer replicas are ready ({time.strftime('%H:%M:%S')}).",
             f"  router ({args.router_policy})    http://{args.host}:{args.port}/v1  "
             f"(model {model}; metrics http://127.0.0.1:{args.router_metrics_port}/metrics)"]
    for r in reps:
        lines.append(f"  {r.name:<20} {r.url}/v1  KV events {r.events} (replay {r.replay}), "
                     f"run dir {r.run_dir}")
    for u in args.worker_url:
        lines.append(f"  {'external':<20} {u}")
    lines += [f"  logs                 {Path(args.run_dir) / 'router.out'}, each replica's "
              "run dir", "Press Ctrl-C to stop."]
    print("\n".join(lines), flush=True)
