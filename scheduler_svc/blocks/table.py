"""A request's blocks: the table the block manager keeps, and the frozen view callers get."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.request import Request


@dataclass(slots=True)
class BlockTable:
    """Per request: device block and host copy of every logical block (None = absent).

    `device` is never changed in place, only replaced: a batch holds its requests' device
    tables (ScheduledChunk.block_table) while the next iteration is planned, and must see
    them as they were when it was planned.
    """

    device: list[int | None] = field(default_factory=list)
    host: list[int | None] = field(default_factory=list)
    # Blocks before this index have a host copy or were queued for one (eager copies
    # resume here instead of rescanning the table every iteration).
    eager_next: int = 0
    # Blocks before this index were offered to the prefix cache (named where they could be).
    cached_next: int = 0

    def __len__(self) -> int:
        return len(self.device)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def num_synced(req: Request, block_size: int) -> int:
    """Full blocks whose KV no batch in flight still writes: their content is final."""
    return req.num_settled_tokens // block_size


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request's blocks as a caller sees them (like vLLM's KVCacheBlocks): a snapshot
    that hides the pools, taken at the call; the live table changes with every block move."""

    device: tuple[int | None, ...] = ()  # each logical block's device block (None: absent)
    host: tuple[int | None, ...] = ()  # and its host copy (None: none)
    num_synced: int = 0  # leading blocks whose content is final (at most len(self))

    @staticmethod
    def of(t: BlockTable | None, synced: int) -> RequestBlocks:
        if t is None:
            return NO_BLOCKS
        return RequestBlocks(tuple(t.device), tuple(t.host), min(synced, len(t)))

    def __len__(self) -> int:
        return len(self.device)

    @property
    def on_device(self) -> bool:
        """Does every logical block have its device block (a running request's table)?"""
        return None not in self.device

    @property
    def num_device(self) -> int:
        return len(self.device) - self.device.count(None)

    @property
    def num_host_prefix(self) -> int:
        """Leading blocks with a host copy: what a request resumes from by swap-in."""
        k = 0
        for h in self.host:
            if h is None:
                break
            k += 1
        return k

    def device_ids(self) -> list[int]:
        """The device block ids, for a request wholly on the device."""
        if not self.on_device:
            raise RuntimeError("the request is not fully on the device")
        return list(self.device)  # type: ignore[arg-type]  # no None in it: checked above


NO_BLOCKS = RequestBlocks()
