"""`superinfer gateway`: flags and the process entry point.

One uvicorn worker on uvloop: the gateway is I/O-bound (gRPC to the scheduler, SSE to
clients) and the in-flight table and the client gRPC server must share one event loop.
uvicorn's access log is off because every request already logs JSON lines with its id.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from common.daemon import PidFile
from common.logging import configure_logging, get_logger
from common.tenants import TenantsError
from gateway.context import GatewaySettings
from gateway.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IN_FLIGHT

API_KEY_ENV = "SUPERINFER_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1", help="address for REST and client gRPC")
    g.add_argument("--port", type=int, default=8000, help="REST (OpenAI-compatible) port")
    g.add_argument("--grpc-port", type=int, default=50050,
                   help="client gRPC API port (0: do not serve it)")
    g.add_argument("--scheduler-addr", default="127.0.0.1:50051", help="scheduler gRPC address")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the scheduler's model name)")
    g.add_argument("--replica-id", default=None,
                   help="this replica's name for a router: /get_server_info's instance_id and "
                        "every response's X-SuperInfer-Replica header (default: HOST:PORT)")
    g.add_argument("--run-dir", default="./.superinfer", help="where gateway.log and gateway.pid go")
    g.add_argument("--log-level", default="info", help="debug, info, warning, error")
    # From the environment by default: a flag's value is visible to every local user in ps.
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and on the client gRPC "
                        f"API (default: ${API_KEY_ENV}, else no auth)")
    g.add_argument("--tenants", default=None, metavar="FILE.toml",
                   help="tenants file: each tenant's hashed API keys, priority, default SLOs "
                        "and limits (docs/tenants.md); reloaded on SIGHUP. Not with --api-key")
    g.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                   help="requests handled at once, REST and gRPC together; past it 429 / "
                        "RESOURCE_EXHAUSTED (0: no limit)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; past it 413")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling for the fields a request leaves unset: the model's own "
                        "(auto: its file's metadata or generation_config.json, else its "
                        "authors' published settings), OpenAI's (vllm: temperature 1, "
                        "top_p 1), or a folder's generation_config.json")
    g.add_argument("--rpc-timeout", type=float, default=5.0,
                   help="deadline of unary scheduler calls, seconds")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="deadline of one generation stream, seconds (default: none)")


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(
        scheduler_addr=args.scheduler_addr,
        host=args.host,
        grpc_port=args.grpc_port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        rpc_timeout_s=args.rpc_timeout,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        max_in_flight=args.max_in_flight,
        generation_config=args.generation_config,
        replica_id=args.replica_id or f"{args.host}:{args.port}",
        tenants_file=args.tenants,
    )


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        configure_logging("gateway", run_dir / "gateway.log", args.log_level)
    except ValueError as e:
        print(f"superinfer gateway: error: {e}", file=sys.stderr)
        return 2
    log = get_logger()
    for name, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if not 0 <= port <= 65535:
            log.error("invalid port", flag=name, port=port)
            return 2
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        log.error("invalid settings", error=str(e))
        return 2
    if not settings.api_key and not settings.tenants_file and not _is_loopback(args.host):
        log.warning("listening beyond loopback without an API key; anyone who can reach "
                    f"{args.host} can generate. Set ${API_KEY_ENV} to require one", host=args.host)
    pid_file = PidFile(run_dir / "gateway.pid")
    try:
        pid_file.acquire()  # one gateway per run dir, like every other service
    except RuntimeError as e:
        log.error("already_running", error=str(e))
        return 1
    try:
        try:
            app = create_app(settings)
        except TenantsError as e:
            log.error("tenants file refused", error=str(e))
            return 2
        config = uvicorn.Config(
            app, host=args.host, port=args.port, loop="uvloop", workers=1,
            access_log=False, log_config=None, log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        log.info("gateway starting", host=args.host, port=args.port, grpc_port=args.grpc_port)
        try:
            server.run()
        except SystemExit as e:  # uvicorn exits on a port it cannot bind
            log.error("gateway could not start", code=e.code)
            return int(e.code or 1)
        return 0 if server.started else 1
    finally:
        pid_file.release()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _standalone() -> int:
    """`python -m gateway.server` while `superinfer gateway` is not wired yet."""
    parser = argparse.ArgumentParser(prog="superinfer gateway")
    add_arguments(parser)
    return main(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(_standalone())
