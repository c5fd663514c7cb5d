"""The block manager's invariants, checked from scratch (tests call it after every step):
no block leaked, referenced more or less often than counted, reused while referenced,
named inconsistently, or out of step with its request's state."""

from __future__ import annotations

from scheduler_svc.blocks.allocator import BlockAllocator
from scheduler_svc.blocks.pool import BlockPool
from scheduler_svc.blocks.prefix import PrefixIndex
from scheduler_svc.blocks.table import BlockTable, RequestBlocks, blocks_for, num_synced
from scheduler_svc.prefix_cache import TierCache
from scheduler_svc.request import Request, RequestState


def check_integrity(pool: BlockPool, tables: dict[str, BlockTable], prefix: PrefixIndex,
                    requests: dict[str, Request]) -> None:
    """Raise AssertionError at the first broken invariant."""
    _check_tier("device", pool.device, pool.pending_device, pool.dev_ref, pool.dev_cache,
                [t.device for t in tables.values()], list(tables), pool)
    _check_tier("host", pool.host, pool.pending_host, pool.host_ref, pool.host_cache,
                [t.host for t in tables.values()], list(tables), None)
    for rid, t in tables.items():
        req = requests.get(rid)
        if req is None:
            raise AssertionError(f"table for unknown request {rid}")
        _check_request(rid, t, req, pool, prefix)


def _check_tier(tier: str, alloc: BlockAllocator, pending: dict[int, list[int]],
                refs: list[int], cache: TierCache, columns: list[list[int | None]],
                rids: list[str], held_in: BlockPool | None) -> None:
    """Every block of the tier is accounted for exactly once: referenced by tables (as
    often as counted), pending on a fence, held for a batch (`held_in`), parked or free."""
    owner: dict[int, str] = {}
    count: dict[int, int] = {}
    for rid, col in zip(rids, columns):
        for b in col:
            if b is None:
                continue
            if b in count and b not in cache.hash_of:
                raise AssertionError(f"unnamed {tier} block {b} shared by {owner[b]} "
                                     f"and {rid}")
            if alloc.is_free(b):
                raise AssertionError(f"{tier} block {b} of {rid} is on the free list")
            owner.setdefault(b, rid)
            count[b] = count.get(b, 0) + 1
    for b, ref in enumerate(refs):
        if ref != count.get(b, 0):
            raise AssertionError(f"{tier} block {b}: {ref} references counted, "
                                 f"{count.get(b, 0)} in tables")
    for fence, blocks in pending.items():
        for b in blocks:
            if b in owner:
                raise AssertionError(f"{tier} block {b} pending on {fence} yet "
                                     f"referenced by {owner[b]}")
            if b in cache.hash_of:
                raise AssertionError(f"{tier} block {b} pending on {fence} yet named")
            owner[b] = f"fence {fence}"
    if held_in is not None:
        for tag, blocks in held_in.held.items():
            for b in blocks:
                if b in owner:
                    raise AssertionError(f"device block {b} held for batch {tag} "
                                         f"yet owned by {owner[b]}")
                if b in cache.hash_of:
                    raise AssertionError(f"device block {b} held yet named")
                owner[b] = f"batch {tag}"
        if sum(map(len, held_in.held.values())) != held_in.num_held:
            raise AssertionError("held block count out of step")
    for b in cache.parked:
        if b in owner:
            raise AssertionError(f"{tier} block {b} cached as unreferenced yet owned "
                                 f"by {owner[b]}")
        if b not in cache.hash_of:
            raise AssertionError(f"{tier} block {b} cached without a name")
        owner[b] = "cache"
    for b, h in cache.hash_of.items():
        if cache.by_hash.get(h) != b:
            raise AssertionError(f"{tier} block {b}: name maps elsewhere")
        if b not in owner:
            raise AssertionError(f"{tier} block {b} named but neither referenced "
                                 "nor cached")
    if len(cache.by_hash) != len(cache.hash_of):
        raise AssertionError(f"{tier}: names out of step")
    used = alloc.num_blocks - alloc.num_free
    if used != len(owner):
        raise AssertionError(f"{tier}: {used} blocks in use, {len(owner)} accounted for")


def _check_request(rid: str, t: BlockTable, req: Request, pool: BlockPool,
                   prefix: PrefixIndex) -> None:
    """The table matches the request's state, and its named blocks hold its own tokens."""
    if len(t.device) != len(t.host):
        raise AssertionError(f"{rid}: device/host table lengths differ")
    blocks = RequestBlocks.of(t, num_synced(req, prefix.block_size))
    need = blocks_for(req.num_computed_tokens, prefix.block_size)
    if req.state is RequestState.RUNNING:
        if not blocks.on_device or len(blocks) < need:
            raise AssertionError(f"{rid} running without all its device blocks")
    elif req.state is RequestState.ROTARY:
        if blocks.num_device or None in blocks.host[:need]:
            raise AssertionError(f"{rid} rotary but KV not wholly on the host")
    else:
        raise AssertionError(f"{rid} in state {req.state} still holds blocks")
    synced = blocks.num_synced
    for i in range(synced, len(blocks)):
        if blocks.host[i] is not None and req.state is RequestState.RUNNING:
            raise AssertionError(f"{rid}: dirty block {i} has a (stale) host copy")
    # A named block holds exactly the KV its name says: the request's own tokens.
    dev_named, host_named = pool.dev_cache.hash_of, pool.host_cache.hash_of
    named = [i for i in range(len(blocks))
             if blocks.device[i] in dev_named or blocks.host[i] in host_named]
    if named and max(named) >= synced:
        raise AssertionError(f"{rid}: named block {max(named)} is not synced "
                             f"({synced} are)")
    hashes = prefix.block_hashes(req, max(named) + 1) if named else []
    for i in named:
        for b, cache in ((blocks.device[i], pool.dev_cache), (blocks.host[i], pool.host_cache)):
            if b is not None and b in cache.hash_of and cache.hash_of[b] != hashes[i]:
                raise AssertionError(f"{rid}: block {i} shares KV of other tokens")

