"""The prefix index (`prefix_caching=True`): a request's block names, naming its settled
full blocks, finding a cached prefix and attaching a waiting request to it.

A settled full block gets a name (a hash of its tokens and all before them, see
scheduler_svc/prefix_cache.py), and blocks are reference counted (pool.py), so that
requests whose tokens agree share them. The rules that keep sharing safe:

* A named block is never written: a request reuses only whole blocks, and at most up to its
  last token's block (which it must compute to sample), so it writes from a fresh block on.
* A block goes back to the pool only when no table references it. An unreferenced named
  block stays *parked* in its tier's LRU: readable by a new request until it is evicted to
  make room. Rotating a sharing request out frees only what no one else holds.
* A parked device block released while a batch in flight may read it is compute-only until
  that batch ends (like a held block): evicted for a swap-in, its copy is late.
* A device block a D2H copy of the open plan reads, or an H2D copy of it fills, is never
  parked when released in that plan: it loses its name and waits for the fence, so no copy
  of the same plan overwrites it.
* A host copy is named as soon as its copy is planned, so the next request needing one
  links it instead of copying again (an eager copy of a shared block happens once); a host
  block written in the open plan is not read by that plan's H2D copies (no host hit on it).
* A device block an H2D copy of the open plan fills may be reused by a request admitted in
  the same plan: the engine step runs a batch only after the swap-ins of its own plan.
* Every plan's copies are complete before the next plan is made (the engine step awaits
  them), so these rules only have to hold within one plan (plan.py).
* When a peer loses memory the lost names are forgotten before any request resumes
  (recovery.py): a lost tier is dropped, never served stale.
"""

from __future__ import annotations

from scheduler_svc.blocks.pool import BlockPool
from scheduler_svc.blocks.table import BlockTable, num_synced
from scheduler_svc.kv_events import NO_EVENTS, KVEventSink
from scheduler_svc.prefix_cache import PrefixHit, TierCache, chain_hash, root_hash
from scheduler_svc.request import Request

NO_HIT = PrefixHit()


class PrefixIndex:
    """Each request's block names, and the cached blocks of both tiers they find."""

    def __init__(self, pool: BlockPool, tables: dict[str, BlockTable], block_size: int,
                 enabled: bool, model_id: str) -> None:
        self.pool = pool
        self.tables = tables
        self.block_size = block_size
        self.enabled = enabled
        self.root = root_hash(model_id)
        self.hashes: dict[str, list[bytes]] = {}

    def set_events(self, events: KVEventSink, host_tier: bool = True) -> None:
        """Report every name given or taken in the device tier, and in the host tier unless
        not `host_tier`, to `events` from now on (scheduler_svc/kv_events.py)."""
        self.pool.dev_cache.events = events
        self.pool.host_cache.events = events if host_tier else NO_EVENTS

    def name(self, cache: TierCache, block: int, req: Request, i: int,
             hashes: list[bytes]) -> None:
        """Name `block` (in `cache`'s tier) as the request's full block i, whose name is
        hashes[i]; a name given is reported as stored in that tier."""
        if cache.name(block, hashes[i]) and cache.events.enabled:
            bs = self.block_size
            cache.events.stored((hashes[i],), hashes[i - 1] if i else None,
                               req.token_ids_slice(i * bs, (i + 1) * bs), cache.medium)

    def block_hashes(self, req: Request, n: int) -> list[bytes]:
        """The names of (at least) the request's first n full blocks: the request's list
        itself, computed once and kept while it lives (it may be longer than n)."""
        hs = self.hashes.setdefault(req.request_id, [])
        if len(hs) < n:
            bs = self.block_size
            parent = hs[-1] if hs else self.root
            for i in range(len(hs), n):
                parent = chain_hash(parent, req.token_ids_slice(i * bs, (i + 1) * bs))
                hs.append(parent)
        return hs

    def forget(self, request_id: str) -> None:
        """The request is gone: its names are not needed any more."""
        self.hashes.pop(request_id, None)

    def cache_full_blocks(self, req: Request) -> None:
        """Name the request's newly settled full blocks (called when its KV settles)."""
        t = self.tables.get(req.request_id)
        if t is None or not self.enabled:
            return
        synced = min(num_synced(req, self.block_size), len(t))
        if t.cached_next >= synced:
            return
        hashes = self.block_hashes(req, synced)
        dev_cache, host_cache = self.pool.dev_cache, self.pool.host_cache
        for i in range(t.cached_next, synced):
            d, h = t.device[i], t.host[i]
            if d is not None:
                self.name(dev_cache, d, req, i, hashes)
            if h is not None:
                self.name(host_cache, h, req, i, hashes)
        t.cached_next = synced

    def host_copy_of(self, req: Request, i: int) -> int | None:
        """A named host copy of the request's synced block i, if the host tier has one."""
        if not self.enabled or i >= num_synced(req, self.block_size):
            return None
        return self.pool.host_cache.by_hash.get(self.block_hashes(req, i + 1)[i])

    def device_reuse(self, req: Request) -> tuple[int, int]:
        """A rotary request's synced blocks the device tier still caches: (how many, how
        many of those a live request references)."""
        t = self.tables.get(req.request_id)
        if t is None or not self.pool.dev_cache.hash_of:
            return 0, 0
        synced = min(num_synced(req, self.block_size), len(t))
        if synced <= 0:
            return 0, 0
        hashes = self.block_hashes(req, synced)
        dev, ref = self.pool.dev_cache.by_hash, self.pool.dev_ref
        reused = shared = 0
        for i in range(synced):
            d = dev.get(hashes[i])
            if d is not None:
                reused += 1
                shared += int(ref[d] > 0)
        return reused, shared

    def lookup(self, req: Request) -> PrefixHit:
        """The longest run of the request's leading full blocks found in a tier (the
        device preferred), for a request holding no blocks. At least its last token is
        left to compute: that is where its next token is sampled from."""
        if not self.enabled or req.request_id in self.tables:
            return NO_HIT
        known = req.num_prompt_tokens + req.num_output_tokens
        limit = min(known, req.num_tokens - 1) // self.block_size
        if limit <= 0:
            return NO_HIT
        hashes = self.block_hashes(req, limit)
        pool = self.pool
        dev, host, ref = pool.dev_cache.by_hash, pool.host_cache.by_hash, pool.dev_ref
        written = pool.iteration.host_written
        hit = PrefixHit()
        for i in range(limit):
            d = dev.get(hashes[i])
            if d is not None:
                hit.blocks.append((True, d))
                hit.device_hits += 1
                hit.shared += int(ref[d] > 0)
                continue
            h = host.get(hashes[i])
            if h is None or h in written:
                break  # (a host block this plan writes cannot be read by it)
            hit.blocks.append((False, h))
            hit.host_hits += 1
        return hit

    def attach(self, req: Request) -> PrefixHit:
        """Admit a waiting request onto its cached prefix: reference the device hits, copy
        the host hits in (their host copies become the request's), and count them computed."""
        hit = self.lookup(req)
        if not hit.blocks:
            return hit
        pool, it = self.pool, self.pool.iteration
        plan = it.get()
        hashes = self.block_hashes(req, hit.num_blocks)
        for on_device, b in hit.blocks:  # first, so that no allocation below evicts them
            (pool.ref_device if on_device else pool.ref_host)(b)
        targets = iter(pool.new_swap_in_targets(hit.host_hits))
        t = self.tables.setdefault(req.request_id, BlockTable())
        devs: list[int | None] = []
        for i, (on_device, b) in enumerate(hit.blocks):
            if on_device:
                devs.append(b)
                h = pool.host_cache.by_hash.get(hashes[i])
                if h is not None:
                    pool.ref_host(h)  # its host copy too: no eager copy needed
                t.host.append(h)
                continue
            d, late = next(targets)
            (plan.late_swap_in if late else plan.swap_in).append((b, d))
            it.filling.add(d)
            it.host_read.add(b)
            self.name(pool.dev_cache, d, req, i, hashes)
            devs.append(d)
            t.host.append(b)
        t.device = devs
        t.cached_next = hit.num_blocks
        req.num_computed_tokens = hit.num_blocks * self.block_size
        return hit
