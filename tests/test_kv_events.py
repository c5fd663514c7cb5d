"""KV events: what the prefix index reports, and the wire they go out on.

A router's view is rebuilt from the events alone (`RouterView`, what vllm-router's index
keeps: per tier, the names stored and not removed since) and must equal the block
manager's named blocks in each tier after every scheduler step, under rotation, eviction
and lost pools. The publisher's frames and replay answers are read back with plain ZMQ
sockets; the real router reads them in tests/test_router.py.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import msgpack
import pytest
import zmq

from common.daemon import free_port
from common.kv_events import KVEventsConfigError, parse_kv_events_config
from scheduler_svc.kv_events import DEVICE_MEDIUM, HOST_MEDIUM, EventBuffer
from scheduler_svc.kv_publisher import KVEventPublisher
from tests.test_prefix_cache import BS, Stepper
from tests.test_scheduler import workload

KEYS = {"BlockStored": {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name"},
        "BlockRemoved": {"type", "block_hashes", "medium"},
        "AllBlocksCleared": {"type"}}


class RouterView:
    """Per tier, the names stored and not removed; each name's tokens, chained."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {DEVICE_MEDIUM: set(), HOST_MEDIUM: set()}
        self.tokens: dict[bytes, tuple[bytes | None, list[int]]] = {}

    def apply(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            assert set(e) == KEYS[e["type"]], e
            if e["type"] == "AllBlocksCleared":
                for names in self.tiers.values():
                    names.clear()
            elif e["type"] == "BlockStored":
                parent, ids = e["parent_block_hash"], e["token_ids"]
                assert e["block_size"] == BS and len(ids) == BS * len(e["block_hashes"])
                assert parent is None or parent in self.tokens, "unknown parent"
                for k, h in enumerate(e["block_hashes"]):
                    assert h not in self.tiers[e["medium"]], "stored twice"
                    self.tokens[h] = (parent, ids[k * BS:(k + 1) * BS])
                    self.tiers[e["medium"]].add(h)
                    parent = h
            else:
                for h in e["block_hashes"]:
                    assert h in self.tiers[e["medium"]], "removed what was not stored"
                    self.tiers[e["medium"]].discard(h)

    def prefix(self, h: bytes) -> list[int]:
        """The tokens of the chain that ends in block h, as the router rebuilds them."""
        out: list[int] = []
        cur: bytes | None = h
        while cur is not None:
            parent, ids = self.tokens[cur]
            out = ids + out
            cur = parent
        return out


def _check(view: RouterView, e: Stepper, host_tier: bool = True) -> None:
    bm = e.sched.bm
    assert view.tiers[DEVICE_MEDIUM] == set(bm.dev_cache.by_hash)
    assert view.tiers[HOST_MEDIUM] == (set(bm.host_cache.by_hash) if host_tier else set())


@pytest.mark.parametrize("host_tier", [True, False])
def test_the_events_rebuild_both_tiers_under_rotation(host_tier: bool) -> None:
    e = Stepper(device=22, host=200, eager=8)
    buf = EventBuffer(BS)
    e.sched.bm.set_event_sink(buf, host_tier=host_tier)
    view = RouterView()
    prompts, lens = workload(30, seed=4, shared=True)
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        e.add(f"r{i}", p, n)
        for _ in range(3):
            e.step()
            view.apply(buf.take())
            _check(view, e, host_tier)
    e.run()
    view.apply(buf.take())
    _check(view, e, host_tier)
    e.check()
    assert e.sched.stats.rotations > 0 and view.tiers[DEVICE_MEDIUM]
    assert bool(view.tiers[HOST_MEDIUM]) == host_tier
    # Every block a router holds names exactly the tokens of a prompt's prefix.
    seqs = [p + e.out[f"r{i}"] for i, p in enumerate(prompts)]
    for h in view.tiers[DEVICE_MEDIUM] | view.tiers[HOST_MEDIUM]:
        toks = view.prefix(h)
        assert any(s[:len(toks)] == toks for s in seqs)


def test_a_lost_pool_removes_its_tier_and_keeps_the_other() -> None:
    e = Stepper(device=24, host=64, eager=16)
    buf = EventBuffer(BS)
    e.sched.bm.set_event_sink(buf)
    view = RouterView()
    e.add("a", list(range(40, 64)), 3)
    e.run()
    view.apply(buf.take())
    assert view.tiers[DEVICE_MEDIUM] and view.tiers[HOST_MEDIUM]
    host = set(view.tiers[HOST_MEDIUM])
    e.sched.device_lost()  # a new worker: the device tier is gone, the host copies stay
    view.apply(buf.take())
    assert view.tiers[DEVICE_MEDIUM] == set() and view.tiers[HOST_MEDIUM] == host
    e.sched.host_lost()  # a new kvmem
    view.apply(buf.take())
    assert view.tiers[HOST_MEDIUM] == set()
    _check(view, e)


def test_the_buffer_joins_a_chain_and_a_clear_drops_what_came_before() -> None:
    buf = EventBuffer(2)
    buf.stored([b"a"], None, [1, 2], "GPU")
    buf.stored([b"b"], b"a", [3, 4], "GPU")  # continues the chain: joined
    buf.stored([b"c"], b"a", [5, 6], "GPU")  # another child of a: a new event
    buf.removed([b"b"], "GPU")
    buf.removed([b"c"], "GPU")
    events = buf.take()
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert events[0]["block_hashes"] == [b"a", b"b"] and events[0]["token_ids"] == [1, 2, 3, 4]
    assert events[2]["block_hashes"] == [b"b", b"c"]
    buf.stored([b"d"], None, [7, 8], "CPU")
    buf.cleared()
    assert buf.take() == [{"type": "AllBlocksCleared"}]
    with pytest.raises(ValueError, match="need 4 token ids"):
        buf.stored([b"e", b"f"], None, [1, 2], "GPU")


def test_the_config_takes_vllms_json_and_names_what_is_wrong() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://*:5557", "replay_endpoint": '
                                 '"tcp://*:5558", "topic": "kv", "buffer_steps": 100}')
    assert cfg is not None and cfg.endpoint.port == 5557 and cfg.endpoint.bind_host == "0.0.0.0"
    assert cfg.replay_endpoint is not None and cfg.topic == "kv" and cfg.buffer_steps == 100
    assert cfg.endpoint.for_peer("10.0.0.2") == "tcp://10.0.0.2:5557"
    assert parse_kv_events_config(cfg.to_json()) == cfg
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config(None) is None
    for bad, says in (("{", "is not JSON"), ("[]", "must be a JSON object"),
                      ('{"endpoint": "tcp://*:70000"}', "'tcp://*:70000' has port 70000"),
                      ('{"endpoint": "ipc:///tmp/x"}', "'ipc:///tmp/x' is not a tcp://HOST:PORT"),
                      ('{"endpont": "tcp://*:1"}', "unknown field 'endpont'"),
                      ('{"topic": "x"}', "endpoint is required"),
                      ('{"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}',
                       "share port 1")):
        with pytest.raises(KVEventsConfigError, match=re.escape(says)):
            parse_kv_events_config(bad)


def test_the_publisher_speaks_vllms_wire_and_replays() -> None:
    pub_port, replay_port = free_port(), free_port()
    cfg = parse_kv_events_config(f'{{"endpoint": "tcp://127.0.0.1:{pub_port}", '
                                 f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", '
                                 '"topic": "kv"}')
    assert cfg is not None
    ctx = zmq.Context()

    async def scenario() -> list[list[bytes]]:
        pub = KVEventPublisher(cfg, block_size=2, flush_delay_s=0.001, resend_idle_s=0.2)
        pub.bind()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        await asyncio.sleep(0.3)  # the subscriber joins before anything is sent
        pub.start()
        await asyncio.sleep(0.05)
        pub.stored([b"h1"], None, [5, 6], "GPU")
        await asyncio.sleep(0.05)
        pub.removed([b"h1"], "GPU")
        await asyncio.sleep(0.5)  # idle: the latest batch goes again, same seq
        frames = []
        while True:
            try:
                frames.append(sub.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        sub.close()
        # A subscriber that missed everything asks the replay socket from seq 1.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big", signed=True)])
        replies = []
        for _ in range(50):
            await asyncio.sleep(0.02)
            try:
                replies.append(dealer.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                continue
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close()
        await pub.close()
        return frames + [[b"replay"]] + replies

    try:
        got = asyncio.run(scenario())
    finally:
        ctx.term()
    cut = got.index([b"replay"])
    live, replay = got[:cut], got[cut + 1:]
    seqs = [int.from_bytes(f[1], "big", signed=True) for f in live]
    assert all(f[0] == b"kv" and len(f) == 3 for f in live)
    assert seqs[:3] == [0, 1, 2] and set(seqs[3:]) == {2}  # the resends repeat seq 2
    batches = [msgpack.unpackb(f[2]) for f in live[:3]]
    for ts, _, rank in batches:
        assert isinstance(ts, float) and rank is None
    assert batches[0][1] == [{"type": "AllBlocksCleared"}]
    assert batches[1][1] == [{"type": "BlockStored", "block_hashes": [b"h1"],
                              "parent_block_hash": None, "token_ids": [5, 6], "block_size": 2,
                              "lora_id": None, "medium": "GPU", "lora_name": None}]
    assert batches[2][1] == [{"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"}]
    # Replay: [b"", topic, seq, payload] per batch from the asked seq, then the end mark.
    assert [int.from_bytes(r[2], "big", signed=True) for r in replay] == [1, 2, -1]
    assert replay[0][:2] == [b"", b"kv"] and replay[0][3] == live[1][2]
    assert replay[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def test_a_bound_port_is_named() -> None:
    port = free_port()
    cfg = parse_kv_events_config(f'{{"endpoint": "tcp://127.0.0.1:{port}"}}')
    assert cfg is not None
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        async def bind() -> None:
            KVEventPublisher(cfg).bind()

        with pytest.raises(RuntimeError, match=f"endpoint tcp://127.0.0.1:{port} \\(port {port}\\)"):
            asyncio.run(bind())
    finally:
        holder.close(linger=0)
        ctx.term()
