"""KV events: what the prefix index tells a router about the blocks it caches, both tiers.

A router that places requests by where their prefix is cached (vllm-router's `kv_aware`,
llm-d's precise prefix scorer, Dynamo's KV router) keeps an index of every replica's
cached blocks, fed by the replica's events in vLLM's format. The prefix index is the one
place that knows which named blocks each tier holds (scheduler_svc/prefix_cache.py,
scheduler_svc/blocks/prefix.py), so it reports every change to a `KVEventSink`:

* `stored(hashes, parent, token_ids, medium)` — blocks got a name in a tier: a device block
  whose KV settled (medium `GPU`), a host copy planned by an eager copy or a rotate-out
  (`CPU`), a device block a swap-in fills. `parent` is the name of the block before the
  first one (None for a prompt's first block), `token_ids` their tokens, whole blocks.
* `removed(hashes, medium)` — those names left that tier only (evicted, reused, lost with
  a restarted worker or kvmem). A block rotated to host memory is removed from `GPU` while
  its `CPU` copy stays stored: the router still credits it, at the host's penalty.
* `cleared()` — every name of both tiers is gone (a scheduler that starts has none).

The default sink does nothing and says so (`enabled` False), so the simulator, the
in-process engine and the tests pay a branch per naming. `EventBuffer` keeps events as
vLLM's map-tagged dicts for a publisher (scheduler_svc/kv_publisher.py, the only module
that knows ZMQ and msgpack). Pure Python, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEVICE_MEDIUM = "GPU"  # vLLM's name for the device tier; the router credits it in full
HOST_MEDIUM = "CPU"  # host memory: credited at the router's host penalty (kv_penalty_host)

Event = dict[str, Any]


class KVEventSink:
    """Receives the prefix index's changes; this one ignores them."""

    enabled = False

    def stored(self, hashes: Sequence[bytes], parent: bytes | None,
               token_ids: Sequence[int], medium: str) -> None:
        return None

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        return None

    def cleared(self) -> None:
        return None


NO_EVENTS = KVEventSink()


def block_stored(hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int],
                 block_size: int, medium: str) -> Event:
    """vLLM's BlockStored as a map: exactly the keys its decoders require (vllm-router
    rejects a whole batch with an unknown or missing key)."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None}


def block_removed(hashes: Sequence[bytes], medium: str) -> Event:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> Event:
    return {"type": "AllBlocksCleared"}


class EventBuffer(KVEventSink):
    """Events since the last `take()`, in order, as vLLM's dicts.

    A store that continues the previous store's chain in the same tier joins it (one event
    for a request's newly named blocks), and removes from one tier in a row join too.
    `cleared()` drops what is pending: nothing before it counts any more.
    """

    enabled = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[Event] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None,
               token_ids: Sequence[int], medium: str) -> None:
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError(f"{len(hashes)} blocks need {len(hashes) * self.block_size} token "
                             f"ids, got {len(token_ids)}")
        last = self.events[-1] if self.events else None
        if (last is not None and last["type"] == "BlockStored" and last["medium"] == medium
                and parent is not None and last["block_hashes"][-1] == parent):
            last["block_hashes"].extend(hashes)
            last["token_ids"].extend(token_ids)
            return
        self.events.append(block_stored(hashes, parent, token_ids, self.block_size, medium))

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
            last["block_hashes"].extend(hashes)
            return
        self.events.append(block_removed(hashes, medium))

    def cleared(self) -> None:
        self.events = [all_blocks_cleared()]

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events
