"""Recovery after a peer lost memory (DESIGN §6): forget what may be gone before any request
resumes, so that no request is ever served a lost tier's stale contents."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.blocks.pool import BlockPool
from scheduler_svc.blocks.table import BlockTable, RequestBlocks, blocks_for, num_synced
from scheduler_svc.request import Request


class LossRecovery:
    """Drops fences, names, host copies and device blocks whose contents a peer lost."""

    def __init__(self, pool: BlockPool, tables: dict[str, BlockTable], block_size: int) -> None:
        self.pool = pool
        self.tables = tables
        self.block_size = block_size

    def _view(self, req: Request) -> RequestBlocks:
        t = self.tables.get(req.request_id)
        return RequestBlocks.of(t, num_synced(req, self.block_size))

    def drop_fences(self) -> None:
        """Release every pending fence: a pool that restarted has no copy in flight."""
        for fence in self.pool.pending_fences:
            self.pool.complete(fence)

    def forget_lost(self, device: bool, host: bool, bad_device: set[int] | None,
                    bad_host: set[int] | None) -> None:
        """Forget the names of blocks whose contents may be gone (a whole tier, or the
        blocks a failed copy wrote); unreferenced ones go back to their pool."""
        pool = self.pool
        for lost_all, bad, cache, alloc in ((device, bad_device, pool.dev_cache, pool.device),
                                            (host, bad_host, pool.host_cache, pool.host)):
            if lost_all:
                alloc.free(cache.clear())
                continue
            for b in bad or ():
                if b in cache.parked:
                    cache.evict(b)
                    alloc.free([b])
                else:
                    cache.forget(b)

    def has_device_block_in(self, req: Request, blocks: set[int]) -> bool:
        return not blocks.isdisjoint(self._view(req).device)

    def drop_host_copies(self, req: Request, lost: Callable[[int], bool]) -> bool:
        """Forget the request's host copies that `lost` names; True if any was dropped.

        The host blocks go back to the pool once no one references them (their contents
        are garbage, the blocks are not); eager copies restart from the first hole.
        """
        t = self.tables.get(req.request_id)
        if t is None:
            return False
        dropped = [i for i, h in enumerate(t.host) if h is not None and lost(h)]
        for i in dropped:
            h = t.host[i]
            assert h is not None
            self.pool.host_cache.forget(h)
            self.pool.unref_host([h])
            t.host[i] = None
        if dropped:
            t.eager_next = min(t.eager_next, dropped[0])
        return bool(dropped)

    def keep_host_prefix(self, req: Request) -> int:
        """Keep only the request's leading blocks that have a host copy; return how many.

        Its device blocks are released (their contents are lost or about to be), and so
        is every host copy after the first block without one: the request resumes by
        swapping the kept prefix in and recomputing from there (DESIGN §6).
        """
        t = self.tables.get(req.request_id)
        if t is None:
            return 0
        limit = min(len(t), blocks_for(req.num_computed_tokens, self.block_size))
        k = min(self._view(req).num_host_prefix, limit)
        self.pool.unref_device([d for d in t.device if d is not None])
        self.pool.unref_host([h for h in t.host[k:] if h is not None])
        del t.host[k:]
        t.device = [None] * k
        t.eager_next = min(t.eager_next, k)
        t.cached_next = min(t.cached_next, k)
        if k == 0:
            del self.tables[req.request_id]
        return k
