"""`--kv-events-config`: where a replica publishes its KV events, in vLLM's terms.

vLLM's flag takes a JSON object (its `KVEventsConfig`); a router (vllm-router's `kv_aware`,
llm-d's precise prefix scorer, Dynamo's KV router) subscribes to the ZMQ PUB socket at
`endpoint` and asks the ROUTER socket at `replay_endpoint` for batches it missed. The same
JSON is accepted here, so a command line written for vLLM works:

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

Parsed and checked here, in the shared layer, because three processes need it: the
scheduler binds the sockets (it owns the prefix index, scheduler_svc/kv_publisher.py),
`superinfer serve` checks their ports are free before it starts anything, and the gateway
tells a router where they are (`/kv_event_sources`). Only `tcp://` endpoints: a port is what
`serve` can check and what a router on another host can reach.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# vLLM's KVEventsConfig fields; those SuperInfer does not use are accepted and ignored so
# that a vLLM command line works unchanged.
_KNOWN = frozenset({"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                    "topic", "buffer_steps", "hwm", "max_queue_size"})
_ENDPOINT = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})")
DEFAULT_BUFFER_STEPS = 10_000  # vLLM's: batches kept for replay
DEFAULT_HWM = 100_000  # vLLM's: messages the PUB socket queues per subscriber


class KVEventsConfigError(ValueError):
    """The --kv-events-config value is wrong; the message names the field and the value."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed `tcp://HOST:PORT`; HOST `*` (or 0.0.0.0) binds every interface."""

    text: str
    host: str
    port: int

    @property
    def bind_host(self) -> str:
        """The address to check and bind: `*` is every interface."""
        return "0.0.0.0" if self.host == "*" else self.host.strip("[]")

    def for_peer(self, host: str) -> str:
        """The endpoint as a router reaches it: a wildcard host becomes `host`."""
        if self.host in ("*", "0.0.0.0", "::", "[::]"):
            return f"tcp://{host}:{self.port}"
        return self.text


def parse_endpoint(text: str, field: str) -> Endpoint:
    m = _ENDPOINT.fullmatch(text)
    if m is None:
        raise KVEventsConfigError(
            f"--kv-events-config: {field} {text!r} is not a tcp://HOST:PORT endpoint "
            "(e.g. tcp://*:5557)")
    port = int(m.group("port"))
    if not 1 <= port <= 65535:
        raise KVEventsConfigError(
            f"--kv-events-config: {field} {text!r} has port {port}, outside 1-65535")
    return Endpoint(text, m.group("host"), port)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    endpoint: Endpoint
    replay_endpoint: Endpoint | None = None
    topic: str = ""
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM

    @property
    def endpoints(self) -> list[tuple[str, Endpoint]]:
        """(field, endpoint) of every socket the scheduler binds."""
        out = [("endpoint", self.endpoint)]
        if self.replay_endpoint is not None:
            out.append(("replay_endpoint", self.replay_endpoint))
        return out

    def to_json(self) -> str:
        """The canonical JSON form (what `serve` hands the scheduler)."""
        d: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": self.endpoint.text, "topic": self.topic,
                             "buffer_steps": self.buffer_steps, "hwm": self.hwm}
        if self.replay_endpoint is not None:
            d["replay_endpoint"] = self.replay_endpoint.text
        return json.dumps(d)


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """The flag's value, or None where events are off (no flag, or
    `enable_kv_cache_events` false, or vLLM's `"publisher": "null"`).
    KVEventsConfigError names what is wrong."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise KVEventsConfigError(f"--kv-events-config is not JSON ({e.msg}): {text!r}") from None
    if not isinstance(raw, dict):
        raise KVEventsConfigError(f"--kv-events-config must be a JSON object, got {text!r}")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise KVEventsConfigError(
            f"--kv-events-config: unknown field {unknown[0]!r}; known: {', '.join(sorted(_KNOWN))}")
    enabled = raw.get("enable_kv_cache_events", True)
    if not isinstance(enabled, bool):
        raise KVEventsConfigError(
            f"--kv-events-config: enable_kv_cache_events must be true or false, got {enabled!r}")
    publisher = raw.get("publisher", "zmq")
    if publisher not in ("zmq", "null"):
        raise KVEventsConfigError(
            f"--kv-events-config: publisher {publisher!r} is not supported; use \"zmq\"")
    if not enabled or publisher == "null":
        return None
    endpoint = raw.get("endpoint")
    if not isinstance(endpoint, str):
        raise KVEventsConfigError(
            "--kv-events-config: endpoint is required, a string like \"tcp://*:5557\"")
    replay = raw.get("replay_endpoint")
    if replay is not None and not isinstance(replay, str):
        raise KVEventsConfigError(
            f"--kv-events-config: replay_endpoint must be a string, got {replay!r}")
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise KVEventsConfigError(f"--kv-events-config: topic must be a string, got {topic!r}")
    ints = {}
    for name, default in (("buffer_steps", DEFAULT_BUFFER_STEPS), ("hwm", DEFAULT_HWM)):
        v = raw.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise KVEventsConfigError(
                f"--kv-events-config: {name} must be a positive integer, got {v!r}")
        ints[name] = v
    cfg = KVEventsConfig(parse_endpoint(endpoint, "endpoint"),
                         parse_endpoint(replay, "replay_endpoint") if replay else None,
                         topic, ints["buffer_steps"], ints["hwm"])
    if cfg.replay_endpoint is not None and cfg.replay_endpoint.port == cfg.endpoint.port:
        raise KVEventsConfigError(
            f"--kv-events-config: endpoint and replay_endpoint share port {cfg.endpoint.port}")
    return cfg
