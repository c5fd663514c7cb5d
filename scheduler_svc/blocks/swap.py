"""Rotation planning: swap-out and swap-in of a request's blocks, what each costs, and the
eager D2H copies of synced blocks (DESIGN §3).

A synced block's host copy stays valid for the request's whole life, so a rotate-out copies
only the blocks without one (the dirty last block, and synced blocks no eager copy reached
yet) and a request rotated out again costs almost nothing. With prefix caching a block
whose host copy the host tier already caches links it instead of copying.
"""

from __future__ import annotations

from scheduler_svc.blocks.pool import BlockPool
from scheduler_svc.blocks.prefix import PrefixIndex
from scheduler_svc.blocks.table import BlockTable, blocks_for, num_synced
from scheduler_svc.request import Request


class SwapPlanner:
    """Adds a request's block copies to the open plan, and prices them beforehand."""

    def __init__(self, pool: BlockPool, tables: dict[str, BlockTable], prefix: PrefixIndex,
                 block_size: int) -> None:
        self.pool = pool
        self.tables = tables
        self.prefix = prefix
        self.block_size = block_size

    def _table(self, req: Request) -> BlockTable:
        return self.tables.setdefault(req.request_id, BlockTable())

    # -- costs (check) ---------------------------------------------------------------------------
    def _swap_out_needs(self, req: Request) -> tuple[list[int], list[int]]:
        """(blocks a rotate-out copies, blocks it links to a cached host copy instead)."""
        t = self.tables.get(req.request_id)
        if t is None:
            return [], []
        n, host = min(blocks_for(req.num_computed_tokens, self.block_size), len(t)), t.host
        if not self.prefix.enabled:  # no named host copies to link
            return [i for i in range(n) if host[i] is None], []
        copy: list[int] = []
        link: list[int] = []
        host_copy_of = self.prefix.host_copy_of
        for i in range(n):
            if host[i] is None:
                (copy if host_copy_of(req, i) is None else link).append(i)
        return copy, link

    def swap_out_cost(self, req: Request) -> int:
        return len(self._swap_out_needs(req)[0])

    def released_by_preempting(self, req: Request, rotate: bool) -> tuple[int, int]:
        t = self.tables.get(req.request_id)
        if t is None:
            return 0, 0
        ref = self.pool.dev_ref
        freed = sum(1 for d in t.device if d is not None and ref[d] == 1)
        if not rotate:
            return freed, 0
        copy, _ = self._swap_out_needs(req)
        devs = t.device
        return freed, sum(1 for i in copy if (d := devs[i]) is not None and ref[d] == 1)

    def preemption_blocks(self, req: Request, rotate: bool) -> tuple[int, int, int]:
        if not rotate:
            return (0, *self.released_by_preempting(req, False))
        t = self.tables.get(req.request_id)
        if t is None:
            return 0, 0, 0
        copy, _ = self._swap_out_needs(req)
        ref, devs = self.pool.dev_ref, t.device
        freed = sum(1 for d in devs if d is not None and ref[d] == 1)
        return len(copy), freed, sum(1 for i in copy if (d := devs[i]) is not None
                                     and ref[d] == 1)

    def swap_in_cost(self, req: Request) -> int:
        t = self.tables.get(req.request_id)
        return 0 if t is None else len(t) - self.prefix.device_reuse(req)[0]

    def admission(self, req: Request, budget: int) -> tuple[int, int, int]:
        """(tokens to compute, device blocks taken from the free and reclaimable ones,
        blocks copied in from the host) if the request were admitted now."""
        t = self.tables.get(req.request_id)
        bs = self.block_size
        if t is not None:  # rotary: its whole table comes back
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            reused, shared = self.prefix.device_reuse(req)
            return n, blocks_for(req.num_computed_tokens + n, bs) - shared, len(t) - reused
        hit = self.prefix.lookup(req)
        start = req.num_computed_tokens + hit.num_blocks * bs
        n = min(req.num_tokens - start, budget)
        return n, blocks_for(start + n, bs) - hit.shared, hit.host_hits

    def can_swap_out(self, req: Request) -> bool:
        return self._host_room_for(req, *self._swap_out_needs(req))

    def _host_room_for(self, req: Request, copy: list[int], link: list[int]) -> bool:
        if not copy:
            return True
        # Linking a parked host copy takes it out of the blocks a copy may evict.
        parked = self.pool.host_cache.parked
        linked = sum(1 for i in link if self.prefix.host_copy_of(req, i) in parked)
        return len(copy) <= self.pool.num_free_host - linked

    def can_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        need = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return need - self.prefix.device_reuse(req)[1] <= self.pool.num_free_for_swap_in

    # -- swap-out (act) ----------------------------------------------------------------------------
    def _trim(self, req: Request) -> None:
        """Release device blocks beyond the computed tokens (allocated but never written)."""
        t = self._table(req)
        keep = blocks_for(req.num_computed_tokens, self.block_size)
        if keep >= len(t.device) and keep >= len(t.host):
            return  # nothing beyond them (most rotate-outs): keep the table as it is
        extra_dev = [b for b in t.device[keep:] if b is not None]
        extra_host = [b for b in t.host[keep:] if b is not None]
        t.device = t.device[:keep]
        del t.host[keep:]
        self.pool.unref_device(extra_dev)
        self.pool.unref_host(extra_host)

    def try_swap_out(self, req: Request) -> tuple[int, int] | None:
        needs = self._swap_out_needs(req)
        if not self._host_room_for(req, *needs):
            return None
        # Without prefix caching the copies depend only on which computed blocks lack a
        # host copy, which trimming the blocks past them does not change; with it, they
        # are worked out again after the trim, as swap_out does.
        return self.swap_out(req, None if self.prefix.enabled else needs)

    def swap_out(self, req: Request,
                 needs: tuple[list[int], list[int]] | None = None) -> tuple[int, int]:
        """(blocks copied D2H, blocks freed with no copy); `needs`: _swap_out_needs(req),
        when known still to hold after the trim."""
        pool, it = self.pool, self.pool.iteration
        plan = it.get()
        self._trim(req)
        t = self._table(req)
        copy, link = self._swap_out_needs(req) if needs is None else needs
        for i in link:
            h = self.prefix.host_copy_of(req, i)
            pool.ref_host(h)  # type: ignore[arg-type]
            t.host[i] = h
        synced = num_synced(req, self.block_size)
        pending = pool.pending_device.setdefault(plan.fence, [])
        sole: list[int] = []
        # Per block copied: kept lean (a rotate-out copies a dozen or more).
        devs, hosts, ref, caching = t.device, t.host, pool.dev_ref, self.prefix.enabled
        pairs, busy, written = plan.swap_out, it.busy, it.host_written
        named = pool.dev_cache.hash_of  # nothing below names a device block
        for i, h in zip(copy, pool.new_host(len(copy)), strict=True):
            d = devs[i]
            assert d is not None
            hosts[i] = h
            pairs.append((d, h))
            busy.add(d)
            written.add(h)
            if caching and i < synced:
                self.prefix.name(pool.host_cache, h, req, i,
                                 self.prefix.block_hashes(req, i + 1))
            if ref[d] == 1:
                # Reusable once the copy has read it; its device name goes (the host has it).
                if named:
                    pool.dev_cache.forget(d)
                ref[d] = 0
                pending.append(d)
            else:
                sole.append(d)  # others hold it: only this reference goes
        copied = set(copy)
        rest = [d for i, d in enumerate(devs) if d is not None and i not in copied]
        pool.unref_device(sole + rest)
        t.device = [None] * len(devs)
        return len(copy), len(rest)

    # -- swap-in and eager copies (act) ------------------------------------------------------------
    def swap_in(self, req: Request) -> int:
        """Copy every block H2D but those the device tier still caches; keep host copies of
        synced blocks valid. Returns the blocks reused without a copy."""
        pool, it = self.pool, self.pool.iteration
        plan = it.get()
        t = self._table(req)
        n = len(t)
        synced = num_synced(req, self.block_size)
        reuse: dict[int, int] = {}
        hashes: list[bytes] = []
        if self.prefix.enabled and min(synced, n) > 0:
            hashes = self.prefix.block_hashes(req, min(synced, n))[:min(synced, n)]
            for i, name in enumerate(hashes):
                cached = pool.dev_cache.by_hash.get(name)
                if cached is not None:
                    reuse[i] = cached
                    pool.ref_device(cached)  # before the allocation below can evict it
        targets = iter(pool.new_swap_in_targets(n - len(reuse)))
        devs: list[int | None] = []
        for i in range(n):
            if i in reuse:
                devs.append(reuse[i])
                continue
            d, late = next(targets)
            h = t.host[i]
            if h is None:
                raise RuntimeError(f"request {req.request_id}: block {i} has no host copy")
            (plan.late_swap_in if late else plan.swap_in).append((h, d))
            it.filling.add(d)
            it.host_read.add(h)
            if i >= synced:
                # The dirty last block will change: its host copy is stale from now on,
                # and reusable once this copy has read it.
                pool.host_ref[h] = 0
                pool.pending_host.setdefault(plan.fence, []).append(h)
                t.host[i] = None
            elif hashes:
                self.prefix.name(pool.dev_cache, d, req, i, hashes)
            devs.append(d)
        t.device = devs
        return len(reuse)

    def eager_copy(self, running: list[Request], budget: int, host_reserve: int) -> int:
        """Queue D2H copies of synced blocks lacking a host copy, oldest first (see
        BlockManager.eager_copy); a block the host tier caches by name links it instead."""
        pool, it = self.pool, self.pool.iteration
        plan = it.get()
        n, bs, tables = 0, self.block_size, self.tables
        caching = self.prefix.enabled
        for req in running:  # every running request, every iteration: kept lean
            t = tables.get(req.request_id)
            # Settled tokens are at most the computed ones: where even those fill no block
            # past eager_next, nothing is newly synced (most requests, most iterations),
            # and the property need not be asked.
            if t is None or t.eager_next >= req.num_computed_tokens // bs:
                continue
            synced = req.num_settled_tokens // bs  # no batch in flight writes these
            if t.eager_next >= synced:
                continue
            synced = min(synced, len(t))
            hashes = self.prefix.block_hashes(req, synced) if caching else None
            for i in range(t.eager_next, synced):
                if n >= budget or pool.num_free_host <= host_reserve:
                    return n
                d = t.device[i]
                if t.host[i] is None and d is not None:
                    cached = pool.host_cache.by_hash.get(hashes[i]) if hashes else None
                    if cached is not None:
                        pool.ref_host(cached)
                        t.host[i] = cached
                    elif hashes and d in it.filling:
                        break  # its contents arrive in this plan: copy it next time
                    else:
                        (h,) = pool.new_host(1)
                        t.host[i] = h
                        plan.eager.append((d, h))
                        it.busy.add(d)
                        it.host_written.add(h)
                        if hashes:
                            self.prefix.name(pool.host_cache, h, req, i, hashes)
                        n += 1
                t.eager_next = i + 1
        return n
