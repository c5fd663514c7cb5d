"""`superinfer worker | kvmem | scheduler | gateway | serve`: the service processes.

Each engine flag belongs to the one service that owns what it sizes: the worker owns the
model and the device pool (`--model`, `--device-blocks`, `--block-size`, `--dtype`, …),
kvmem the host pool (`--host-blocks`, `--host-memory-gib`), the scheduler everything about
scheduling. `serve` takes them all and hands each child its own.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType, ModuleType

from common.config import EngineConfig
from common.daemon import add_daemon_arguments
from common.generation_defaults import check_mode
from common.kv_events import parse_kv_events_config
from common.logging import configure_logging
from superinfer.ports import Port, port_problem, run_dir_problem
from superinfer.probes import (
    HEALTH_HELP,
    add_health_arguments,
    grpc_alive,
    grpc_probe,
    http_alive,
    http_probe,
    run_health,
)
from superinfer.supervisor import (
    RestartPolicy,
    ServiceFailed,
    ServiceSpec,
    Supervisor,
    die_with_supervisor,
)

PORTS = {"scheduler": 50051, "worker": 50052, "kvmem": 50053}
GATEWAY_HTTP_PORT = 8000
GATEWAY_GRPC_PORT = 50050
WORKER_FLAGS = frozenset({"model", "device_blocks", "kv_memory_gib", "block_size", "dtype",
                          "kv_dtype", "device", "tensor_parallel_size"})
KVMEM_FLAGS = frozenset({"host_blocks", "host_memory_gib"})


def _engine_actions() -> list[tuple[str | None, argparse.Action]]:
    """Every EngineConfig flag with its group title, from the one place that defines them."""
    scratch = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_arguments(scratch)
    return [(g.title, a) for g in scratch._action_groups for a in g._group_actions]


def _add_engine_flags(p: argparse.ArgumentParser, keep: Callable[[str], bool]) -> None:
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for title, action in _engine_actions():
        if keep(action.dest):
            if title not in groups:
                groups[title] = p.add_argument_group(title)
            groups[title]._add_action(action)


def _scheduler_flag(dest: str) -> bool:
    return dest not in WORKER_FLAGS and dest not in KVMEM_FLAGS


# -- the standalone services ----------------------------------------------------------------
def _add_worker(p: argparse.ArgumentParser) -> None:
    add_daemon_arguments(p, PORTS["worker"])
    _add_engine_flags(p, WORKER_FLAGS.__contains__)


def _add_kvmem_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kvmem (DuplexKV)")
    g.add_argument("--transfer-mode", default="duplex",
                   choices=["duplex", "block-first", "layer-first"],
                   help="DuplexKV mode (layer-first is the vLLM 0.6 baseline)")
    g.add_argument("--numa-node", default="auto",
                   help="host pool NUMA node: auto (nearest the GPU), off, or a number")


def _add_kvmem(p: argparse.ArgumentParser) -> None:
    add_daemon_arguments(p, PORTS["kvmem"])
    _add_engine_flags(p, KVMEM_FLAGS.__contains__)
    _add_kvmem_flags(p)


def _add_scheduler(p: argparse.ArgumentParser) -> None:
    add_daemon_arguments(p, PORTS["scheduler"])
    g = p.add_argument_group("peers")
    g.add_argument("--worker-addr", default=f"127.0.0.1:{PORTS['worker']}")
    g.add_argument("--kvmem-addr", default=f"127.0.0.1:{PORTS['kvmem']}")
    g.add_argument("--connect-timeout", type=float, default=300.0,
                   help="seconds to wait for the worker and kvmem to be SERVING, at start "
                        "and whenever one restarts (requests wait, then fail)")
    g.add_argument("--batch-timeout", type=float, default=120.0,
                   help="deadline of one Execute or Transfer call, seconds (a hung peer "
                        "fails the iteration, which is then recovered)")
    g.add_argument("--shutdown-grace", type=float, default=3.0,
                   help="on SIGTERM, seconds live requests may take to finish before they "
                        "are cancelled with an error")
    _add_kv_events_flag(p)
    _add_engine_flags(p, _scheduler_flag)


def _add_kv_events_flag(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV events for a router (docs/routers.md)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the prefix cache's blocks of both tiers as vLLM's KV events: "
                        "vLLM's JSON, e.g. '{\"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}' (default: off)")
    g.add_argument("--kv-events-tiers", default="both", choices=["both", "device"],
                   help="the tiers KV events report: both (a block rotated to host memory "
                        "stays a prefix hit there) or device (as an engine with one tier)")


def _run(module: str) -> Callable[[argparse.Namespace], int]:
    """Import a service only when it runs: `superinfer --help` need not load torch."""

    def run(args: argparse.Namespace) -> int:
        die_with_supervisor()
        if module == "kvmem_svc.service":
            from kvmem_svc.tunables import reexec_with_copy_tunables

            reexec_with_copy_tunables()  # before torch loads: glibc reads tunables at start
        return int(importlib.import_module(module).main(args) or 0)

    return run


def _gateway_module() -> ModuleType | None:
    """gateway.server, when it exists (it provides `add_arguments(p)` and `main(args)`)."""
    try:
        if importlib.util.find_spec("gateway.server") is None:
            return None
    except ImportError:
        return None
    return importlib.import_module("gateway.server")


# -- serve ------------------------------------------------------------------------------------
def _add_serve(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1", help="REST and client gRPC listen address")
    g.add_argument("--port", type=int, default=GATEWAY_HTTP_PORT, help="REST port")
    g.add_argument("--grpc-port", type=int, default=GATEWAY_GRPC_PORT, help="client gRPC port")
    # Passed to the gateway by name; the API key only through $SUPERINFER_API_KEY, which
    # the gateway inherits, so that it never shows on a command line.
    g.add_argument("--max-in-flight", type=int, default=None,
                   help="requests the gateway handles at once; past it 429 (default 1024)")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; past it 413 (default 4 MiB)")
    g.add_argument("--generation-config", default=None, metavar="auto|vllm|FOLDER",
                   help="sampling for the fields a request leaves unset: the model's own "
                        "(auto, default), OpenAI's (vllm), or a folder's "
                        "generation_config.json")
    g.add_argument("--replica-id", default=None,
                   help="this replica's name for a router: /get_server_info's instance_id and "
                        "every response's X-SuperInfer-Replica header (default: HOST:PORT)")
    g.add_argument("--tenants", default=None, metavar="FILE.toml", type=_absolute,
                   help="tenants file: each tenant's hashed API keys, priority, default SLOs "
                        "and limits (docs/tenants.md); `kill -HUP` serve (or the gateway) "
                        "reloads it. Not with $SUPERINFER_API_KEY")
    _add_kv_events_flag(p)  # handed to the scheduler by name
    _add_kvmem_flags(p)  # handed to kvmem by name
    s = p.add_argument_group("services (listen on 127.0.0.1)")
    s.add_argument("--scheduler-port", type=int, default=PORTS["scheduler"])
    s.add_argument("--worker-port", type=int, default=PORTS["worker"])
    s.add_argument("--kvmem-port", type=int, default=PORTS["kvmem"])
    s.add_argument("--run-dir", default="./.superinfer", help="pid and log files go here")
    s.add_argument("--log-level", default="info")
    s.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds each service may take to become ready")
    s.add_argument("--shutdown-grace", type=float, default=3.0,
                   help="on SIGTERM/Ctrl-C, seconds in-flight requests may take to finish "
                        "before they are cancelled with an error")
    r = p.add_argument_group("restarts (a service that dies is restarted)")
    r.add_argument("--max-restarts", type=int, default=5,
                   help="deaths of one service within --restart-window after which serve "
                        "gives up and stops (0: stop at the first death)")
    r.add_argument("--restart-window", type=float, default=120.0, help="seconds")
    r.add_argument("--restart-backoff", type=float, default=0.5,
                   help="first restart delay, seconds; doubles per death up to 10 s")
    r.add_argument("--liveness-timeout", type=float, default=30.0,
                   help="kill and restart a service that answers no health check for this "
                        "many seconds (hung or stopped); 0 turns the check off")
    EngineConfig.add_arguments(p)


def _argv_for(add: Callable[[argparse.ArgumentParser], None], values: dict[str, object]) -> list[str]:
    """Command-line flags for a child whose parser `add` builds, from `values` by dest."""
    scratch = argparse.ArgumentParser(add_help=False)
    add(scratch)
    argv: list[str] = []
    for action in scratch._actions:
        value = values.get(action.dest)
        if isinstance(action, argparse.BooleanOptionalAction) and value is not None:
            # --flag / --no-flag: say which, always (its last spelling is the --no- one).
            on, off = action.option_strings[0], action.option_strings[-1]
            argv.append(on if value else off)
            continue
        if not action.option_strings or value is None or value is False:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))  # its first name
        if action.nargs == 0:  # store_true and the like
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def service_specs(args: argparse.Namespace) -> list[ServiceSpec]:
    """The children of `serve`, in start order, each with its flags and readiness probe."""
    run_dir = Path(args.run_dir)
    common = {**vars(args), "host": "127.0.0.1"}
    addr = {name: f"127.0.0.1:{getattr(args, f'{name}_port')}" for name in PORTS}
    base = [sys.executable, "-m", "superinfer.cli"]
    specs = [
        ServiceSpec("worker", [*base, "worker", *_argv_for(_add_worker, {
            **common, "port": args.worker_port})], grpc_probe(addr["worker"]),
            run_dir / "worker.pid", stop_stage=0, alive=grpc_alive(addr["worker"])),
        ServiceSpec("kvmem", [*base, "kvmem", *_argv_for(_add_kvmem, {
            **common, "port": args.kvmem_port})], grpc_probe(addr["kvmem"]),
            run_dir / "kvmem.pid", stop_stage=1, alive=grpc_alive(addr["kvmem"])),
        # Stops together with the gateway: its drain ends the gateway's streams cleanly.
        ServiceSpec("scheduler", [*base, "scheduler", *_argv_for(_add_scheduler, {
            **common, "port": args.scheduler_port, "worker_addr": addr["worker"],
            "kvmem_addr": addr["kvmem"], "connect_timeout": args.startup_timeout})],
            grpc_probe(addr["scheduler"]), run_dir / "scheduler.pid", stop_stage=2,
            alive=grpc_alive(addr["scheduler"])),
    ]
    gateway = _gateway_module()
    if gateway is not None:
        probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        specs.append(ServiceSpec("gateway", [*base, "gateway", *_argv_for(gateway.add_arguments, {
            **vars(args), "scheduler_addr": addr["scheduler"]})],
            http_probe(f"http://{probe_host}:{args.port}/health"), run_dir / "gateway.pid",
            # /livez, not /health: /health asks the scheduler, and a stopped scheduler must
            # not get a working gateway killed.
            stop_stage=2, alive=http_alive(f"http://{probe_host}:{args.port}/livez")))
    return specs


def _absolute(path: str) -> str:
    """A file a child reads: absolute, so that its working directory does not matter."""
    return str(Path(path).resolve())


def check_tenants(path: str) -> None:
    """A tenants file the gateway would refuse, or one beside a single API key: a
    ValueError saying what is wrong (the file's line), before anything starts."""
    from common.tenants import load

    load(path)
    if os.environ.get("SUPERINFER_API_KEY"):
        raise ValueError("both --tenants and $SUPERINFER_API_KEY are set; with tenants every "
                         "key belongs to a tenant: put its hash in the file (`superinfer "
                         "tenants hash-key`) and unset SUPERINFER_API_KEY")


class _Terminate(Exception):
    """SIGTERM, turned into an exception so that serve unwinds like on Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminate


def check_tensor_parallel(args: argparse.Namespace) -> str | None:
    """A --tensor-parallel-size the model cannot split: the error, before any process."""
    n = getattr(args, "tensor_parallel_size", 1)
    if n == 1:
        return None
    from common.errors import SuperInferError
    from common.modelfile import resolve_model
    from worker.cuda.device import resolve_device
    from worker.tp import check_source

    try:
        if resolve_device(getattr(args, "device", "auto")) != "cpu":
            return ("--tensor-parallel-size > 1 runs on the CPU worker only so far "
                    "(worker/tp.py); add --device cpu")
        check_source(n, resolve_model(args.model))
    except SuperInferError as e:  # DeviceError is one
        return str(e)
    return None


def serve_ports(args: argparse.Namespace) -> list[Port]:
    """Every port `serve`'s children will listen on, with the flag that names it."""
    ports = [Port("--port", args.host, args.port)]
    if args.grpc_port:
        ports.append(Port("--grpc-port", args.host, args.grpc_port))
    ports += [Port(f"--{name}-port", "127.0.0.1", getattr(args, f"{name}_port"))
              for name in ("scheduler", "worker", "kvmem")]
    events = parse_kv_events_config(args.kv_events_config)
    if events is not None:
        ports += [Port(f"--kv-events-config {field}", ep.bind_host, ep.port)
                  for field, ep in events.endpoints]
    return ports


def check_serve(args: argparse.Namespace, ports_too: bool = True) -> str | None:
    """What stops `serve` before it starts anything: a flag's value, a port in use (unless
    not `ports_too`: `replicas` checks all of its replicas' together), a run dir another
    serve holds (superinfer/ports.py)."""
    try:
        EngineConfig.from_args(args)  # flag errors here, not in a child's log
        if args.generation_config is not None:
            check_mode(args.generation_config)
        if args.tenants:
            check_tenants(args.tenants)  # TenantsError is a ValueError
        ports = serve_ports(args)  # KVEventsConfigError is a ValueError
    except ValueError as e:
        return str(e)
    return (check_tensor_parallel(args) or run_dir_problem(Path(args.run_dir))
            or (port_problem(ports) if ports_too else None))


def _serve(args: argparse.Namespace) -> int:
    problem = check_serve(args)
    if problem:
        print(f"superinfer serve: error: {problem}; nothing was started", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    try:
        policy = RestartPolicy(backoff_s=args.restart_backoff,
                               max_backoff_s=max(10.0, args.restart_backoff),
                               max_restarts=args.max_restarts, window_s=args.restart_window)
        # Restarts and stops are logged as JSON lines, to stderr and supervisor.log.
        configure_logging("supervisor", run_dir / "supervisor.log", args.log_level)
    except ValueError as e:
        print(f"superinfer serve: error: {e}", file=sys.stderr)
        return 2
    # A stage stops once its drain is over: the grace period, plus time to unwind.
    if args.liveness_timeout < 0:
        print("superinfer serve: error: --liveness-timeout must be >= 0", file=sys.stderr)
        return 2
    sup = Supervisor(run_dir, stop_timeout_s=args.shutdown_grace + 10.0,
                     liveness_timeout_s=args.liveness_timeout)
    specs = service_specs(args)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # SIGHUP reloads the tenants file: the gateway reads it (and keeps the old one when the
    # new one is bad); without a tenants file it has nothing to reload.
    signal.signal(signal.SIGHUP, lambda signum, frame: sup.send_signal("gateway", signal.SIGHUP))
    rc = 0
    try:
        print(f"starting {', '.join(spec.name for spec in specs)} …", file=sys.stderr,
              flush=True)
        sup.start_all(specs, args.startup_timeout)
        _print_ready(args, specs, run_dir)
        failed = sup.wait(poll_s=0.1, restart=policy if args.max_restarts else None,
                          startup_timeout_s=args.startup_timeout)
        print(f"superinfer: {failed.name} {failed.why}; stopping the others\n"
              f"--- last lines of {run_dir / (failed.name + '.out')}:\n{failed.tail}",
              file=sys.stderr)
        rc = 1
    except ServiceFailed as e:
        print(f"superinfer: {e.name} {e.why}; stopping the others\n"
              f"--- last lines of {run_dir / (e.name + '.out')}:\n{e.tail}", file=sys.stderr)
        rc = 1
    except (KeyboardInterrupt, _Terminate):
        print("stopping …", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        sup.stop_all()
    return rc


def _print_ready(args: argparse.Namespace, specs: list[ServiceSpec], run_dir: Path) -> None:
    names = [s.name for s in specs]
    lines = ["SuperInfer is ready."]
    if "gateway" in names:
        lines += [f"  REST (OpenAI-compatible)  http://{args.host}:{args.port}/v1",
                  f"  client gRPC               {args.host}:{args.grpc_port}"]
    else:
        lines.append("  gateway                   not installed (gateway/server.py missing)")
    events = parse_kv_events_config(args.kv_events_config)
    if events is not None:
        lines.append(f"  KV events (ZMQ PUB)       {events.endpoint.text}"
                     + (f", replay {events.replay_endpoint.text}"
                        if events.replay_endpoint else ""))
    lines += [f"  scheduler gRPC            127.0.0.1:{args.scheduler_port}",
              f"  run dir                   {run_dir.resolve()}",
              "  logs                      "
              + ", ".join(str(run_dir / f"{n}.log") for n in names),
              "Press Ctrl-C to stop."]
    print("\n".join(lines), flush=True)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="serve the model and the device KV pool (gRPC)")
    _add_worker(p)
    p.set_defaults(func=_run("worker.service"))
    p = sub.add_parser("kvmem", help="serve the host KV pool and block transfers (gRPC)")
    _add_kvmem(p)
    p.set_defaults(func=_run("kvmem_svc.service"))
    p = sub.add_parser("scheduler", help="serve the engine core: requests, blocks, policy (gRPC)")
    _add_scheduler(p)
    p.set_defaults(func=_run("scheduler_svc.service"))
    gateway = _gateway_module()
    if gateway is not None:
        p = sub.add_parser("gateway", help="serve the REST and client gRPC APIs")
        gateway.add_arguments(p)
        p.set_defaults(func=_run("gateway.server"))
    p = sub.add_parser("health", help=HEALTH_HELP)  # main() takes a shortcut to it
    add_health_arguments(p)
    p.set_defaults(func=run_health)
    p = sub.add_parser("serve", help="run worker, kvmem, scheduler and gateway together")
    _add_serve(p)
    p.set_defaults(func=_serve)
