"""Automatic prefix caching: full blocks named by their contents, kept after their requests.

A synced block's KV is a function of the model and of every token up to its end, so it is
named by a hash chained over its parent block's name and its own token ids, rooted in the
model's identity (`root_hash`). Two requests whose token sequences agree on the first k full
blocks have the same k names, and the second can use the first's KV for them.

Each tier keeps a `TierCache`: name -> block, block -> name, and the blocks no request
references any more, least recently released first. Those stay readable until a block is
needed and the oldest is evicted (its name forgotten). The device tier is what a new
request reuses directly; the host tier is the host copies DuplexKV already makes (eager
copies, rotate-outs): a prefix no longer on the device but in host memory is copied in
instead of recomputed. Reference counts and every rule about when a block may be reused
(fences, batches in flight) live in the block manager (scheduler_svc/blocks/pool.py); this
module only names blocks.

Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_svc.kv_events import DEVICE_MEDIUM, NO_EVENTS, KVEventSink


def root_hash(model_id: str) -> bytes:
    """The name every chain starts from: KV of another model (or dtype) never matches."""
    return hashlib.sha256(b"superinfer-prefix\0" + model_id.encode()).digest()


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: its parent's name and its token ids (SHA-256, so that a
    collision, which would serve another prompt's KV, is out of reach)."""
    h = hashlib.sha256(parent)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


class TierCache:
    """One tier's named blocks and, among them, the unreferenced ones in LRU order.

    `parked` maps an unreferenced block to a tag the block manager gives it (the newest
    batch in flight when it was released: until that batch is done the block may still be
    read, see blocks/pool.py). Insertion order is release order, so the oldest comes first.

    Every name that goes is reported to `events` as removed from this tier's `medium`
    (scheduler_svc/kv_events.py); names given are reported by the prefix index, which
    knows their tokens.
    """

    __slots__ = ("by_hash", "hash_of", "parked", "medium", "events")

    def __init__(self, medium: str = DEVICE_MEDIUM, events: KVEventSink = NO_EVENTS) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.parked: OrderedDict[int, int] = OrderedDict()
        self.medium = medium
        self.events = events

    def __len__(self) -> int:
        return len(self.hash_of)

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def name(self, block: int, h: bytes) -> bool:
        """Give `block` the name `h` unless another block has it already (a duplicate stays
        private and is freed as usual)."""
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        return True

    def forget(self, block: int) -> None:
        """The block's contents no longer count: drop its name (it must not be parked)."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.by_hash[h]
            if self.events.enabled:
                self.events.removed((h,), self.medium)

    def park(self, block: int, tag: int) -> None:
        self.parked[block] = tag

    def unpark(self, block: int) -> bool:
        """Referenced again; True if it was parked."""
        return self.parked.pop(block, None) is not None

    def oldest(self) -> tuple[int, int] | None:
        """(block, tag) of the least recently released unreferenced block."""
        return next(iter(self.parked.items()), None)

    def evict_oldest(self) -> int:
        block, _ = self.parked.popitem(last=False)
        self.forget(block)
        return block

    def evict(self, block: int) -> None:
        """Take a parked block out of the cache (its contents are lost, or it is reused)."""
        del self.parked[block]
        self.forget(block)

    def clear(self) -> list[int]:
        """Forget every name; return the parked blocks (now owned by no one)."""
        parked = list(self.parked)
        if self.events.enabled and self.by_hash:
            self.events.removed(list(self.by_hash), self.medium)
        self.by_hash.clear()
        self.hash_of.clear()
        self.parked.clear()
        return parked


@dataclass(slots=True)
class PrefixHit:
    """What a waiting request would reuse if admitted now: its first `len(blocks)` blocks,
    each (True, device block) or (False, host block to copy in)."""

    blocks: list[tuple[bool, int]] = field(default_factory=list)
    device_hits: int = 0
    host_hits: int = 0
    # Device hits that a live request references: they cost the admission no free block.
    shared: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)
