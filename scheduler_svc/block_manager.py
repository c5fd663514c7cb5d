"""Two-tier KV block manager: device and host block allocators and per-request tables.

Pure Python. A request's KV is a list of logical blocks of `block_size` tokens. Each
logical block may live on the device (a device block id) and may have a valid host copy
(a host block id). Block i is *synced* once its tokens are all computed: its content never
changes again, so a host copy of it stays valid for the request's whole life (DESIGN §3).

Fences: a device block whose content is still being copied to the host is not reusable
until that copy completes, and a host block that is the source of an in-flight copy is not
reusable either. Such blocks sit in `_pending_*[fence]` until `complete(fence)`.

One exception, from the serial iteration contract (the step finishes an iteration's
transfers before that iteration executes): a device block freed by this iteration's
rotate-out may be handed to *compute* in the same iteration (the worker writes it only
after the copy has read it), but never to a swap-in, whose H2D copy would run at the same
time as the D2H copy reading it. The pipelined step copies rotate-outs beside the next
execution, so there (`same_iteration_reuse=False`) such a block waits for its fence.

Executes in flight (`begin_execute` / `end_execute`): a device block released while a
batch that may read or write it is still running is *compute-only* until that batch ends.
The worker runs batches in order, so the next batch may write it; a swap-in, whose H2D
copy runs beside the batch in flight, may not.

Prefix caching (`prefix_caching=True`, scheduler_svc/prefix_cache.py): a settled full block
gets a name (a hash of its tokens and all before them), and blocks are reference counted,
so that requests whose tokens agree share them. The rules that keep sharing safe:

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
  them), so these rules only have to hold within one plan.
* When a peer loses memory the lost names are forgotten before any request resumes
  (`forget_lost`): a lost tier is dropped, never served stale.

n choices of one prompt (`fork`, scheduler_svc/fork.py) share the leader's full prompt
blocks by the same reference counts, with caching on or off: a follower's table starts
with references to them, so no block is written by two requests and none is freed while
another choice holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from common.contracts import TransferPlan
from scheduler_svc.prefix_cache import PrefixHit, TierCache, chain_hash, root_hash
from scheduler_svc.request import Request, RequestState


class BlockAllocator:
    """Free list of one tier's blocks. LIFO so that hot blocks are reused first."""

    __slots__ = ("num_blocks", "_free", "_is_free")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        free = self._free
        if n > len(free):
            raise MemoryError(f"asked for {n} blocks, {len(free)} free")
        keep = len(free) - n
        out = free[keep:][::-1]  # pop()'s order, the last freed first, in one slice
        del free[keep:]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"double free of block {b}")
            self._is_free[b] = True
            self._free.append(b)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]


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


NO_HIT = PrefixHit()


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 same_iteration_reuse: bool = True, prefix_caching: bool = False,
                 model_id: str = "") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.same_iteration_reuse = same_iteration_reuse
        self.device = BlockAllocator(num_device_blocks)
        self.host = BlockAllocator(num_host_blocks)
        self._tables: dict[str, BlockTable] = {}
        # References from tables to each block (0: free, pending, held, or parked cached).
        self._dev_ref = [0] * num_device_blocks
        self._host_ref = [0] * num_host_blocks
        self._pending_device: dict[int, list[int]] = {}
        self._pending_host: dict[int, list[int]] = {}
        self._open: TransferPlan | None = None
        # Device blocks this iteration's D2H copies read. One of them handed to compute and
        # released again before the plan closes must not reach the free list: a swap-in of
        # the same iteration could get it and write it while the D2H copy still reads it.
        self._open_busy: set[int] = set()
        # Device blocks this iteration's H2D copies fill, and host blocks its D2H copies
        # write (see the prefix-caching rules at the top).
        self._open_filling: set[int] = set()
        self._open_host_written: set[int] = set()
        self._open_host_read: set[int] = set()
        self._next_fence = 1
        self._eager_queue: deque[str] = deque()
        self._executing: list[int] = []  # iterations whose batch is in flight, in order
        self._held: dict[int, list[int]] = {}  # compute-only blocks, by the batch they wait for
        self._num_held = 0
        # Prefix caching: named blocks per tier, and each request's block names so far.
        self.prefix_caching = prefix_caching
        self.dev_cache = TierCache()
        self.host_cache = TierCache()
        self._root = root_hash(model_id)
        self._hashes: dict[str, list[bytes]] = {}

    # -- sizes ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device(self) -> int:
        """Free device blocks, the parked cached ones included (reclaimable at once)."""
        return self.device.num_free + self.dev_cache.num_parked

    @property
    def num_free_host(self) -> int:
        return self.host.num_free + self.host_cache.num_parked

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_cached_device(self) -> int:
        """Device blocks kept only for the prefix cache (no request references them)."""
        return self.dev_cache.num_parked

    @property
    def num_cached_host(self) -> int:
        return self.host_cache.num_parked

    def device_table(self, request_id: str) -> list[int]:
        """A running request's device block table: the live list (not a copy), every entry
        a device block. Valid until the next block move; copy it to keep it."""
        return self._tables[request_id].device  # type: ignore[return-value]

    @property
    def tables(self) -> Mapping[str, BlockTable]:
        """Every request's block table, to read only: the scheduler's per-iteration paths
        look at the whole batch's tables without a call per request."""
        return self._tables

    def table(self, req: Request) -> BlockTable:
        return self._tables.setdefault(req.request_id, BlockTable())

    def device_block_ids(self, req: Request) -> list[int]:
        """The request's device block table itself (not a copy): valid until it changes."""
        t = self._tables[req.request_id]
        if None in t.device:
            raise RuntimeError(f"request {req.request_id} is not fully on the device")
        return t.device  # type: ignore[return-value]  # no None in it: checked above

    def num_device_blocks_of(self, req: Request) -> int:
        t = self._tables.get(req.request_id)
        return 0 if t is None else len(t.device) - t.device.count(None)

    @property
    def num_used_device(self) -> int:
        """Device blocks some table references (a block shared by several counts once)."""
        return sum(1 for r in self._dev_ref if r)

    @property
    def num_shared_device(self) -> int:
        """Device blocks more than one table references."""
        return sum(1 for r in self._dev_ref if r > 1)

    def fork(self, leader: Request, follower: Request, num_blocks: int) -> None:
        """The follower's table starts with the leader's first `num_blocks` blocks (device,
        and their host copies where the leader has them), referenced, not copied: their
        content must be final (full blocks the leader has settled)."""
        if follower.request_id in self._tables:
            raise RuntimeError(f"{follower.request_id} holds blocks already; it cannot fork")
        src = self._tables[leader.request_id]
        devs = src.device[:num_blocks]
        if len(devs) < num_blocks or None in devs:
            raise RuntimeError(f"{leader.request_id} does not hold {num_blocks} device blocks")
        hosts = src.host[:num_blocks]
        for d in devs:
            self._ref_device(d)  # type: ignore[arg-type]  # no None: checked above
        for h in hosts:
            if h is not None:
                self._ref_host(h)
        self._tables[follower.request_id] = BlockTable(
            device=list(devs), host=list(hosts), eager_next=min(src.eager_next, num_blocks),
            cached_next=min(src.cached_next, num_blocks))

    def num_synced(self, req: Request) -> int:
        """Full blocks whose KV no batch in flight still writes: their content is final."""
        return req.num_settled_tokens // self.block_size

    # -- the iteration's transfer plan and fences ---------------------------------------------
    def begin_iteration(self) -> None:
        self._open = TransferPlan(fence=self._next_fence)
        self._next_fence += 1

    def end_iteration(self) -> TransferPlan | None:
        """Close the iteration's plan; None when it moves nothing (its fence is released)."""
        plan, self._open = self._open, None
        self._open_busy.clear()
        self._open_filling.clear()
        self._open_host_written.clear()
        self._open_host_read.clear()
        if plan is None:
            return None
        if not plan:
            self.complete(plan.fence)
            return None
        return plan

    @property
    def num_late_swap_in(self) -> int:
        """Swap-ins of the open plan that must wait for the batch in flight."""
        return len(self._open.late_swap_in) if self._open is not None else 0

    def _plan(self) -> TransferPlan:
        if self._open is None:
            raise RuntimeError("block moves need begin_iteration() first")
        return self._open

    def _release_device(self, blocks: list[int]) -> None:
        """Return unreferenced, unnamed device blocks: to the free list; to the open fence if
        a copy of it touches them; or compute-only while a batch that may touch them is in
        flight."""
        busy, filling = self._open_busy, self._open_filling
        if not busy and not filling and not self._executing:
            self.device.free(blocks)
            return
        free: list[int] = []  # in order, freed at once (a call per block was most of it)
        for b in blocks:
            if b in busy or b in filling:
                self._pending_device.setdefault(self._plan().fence, []).append(b)
            elif self._executing:
                self._held.setdefault(self._executing[-1], []).append(b)
                self._num_held += 1
            else:
                free.append(b)
        if free:
            self.device.free(free)

    def _unref_device(self, blocks: list[int]) -> None:
        """Tables drop these references; a block no table references any more is parked
        (named, see the top) or released."""
        ref, cache = self._dev_ref, self.dev_cache
        done: list[int] = []
        # A table's last blocks are parked first, so evicted first: a prefix's head, which
        # every longer prefix needs, stays longest.
        for b in reversed(blocks) if self.prefix_caching else blocks:
            ref[b] -= 1
            if ref[b]:
                continue
            if b in cache.hash_of:
                if b not in self._open_busy and b not in self._open_filling:
                    cache.park(b, self._executing[-1] if self._executing else 0)
                    continue
                cache.forget(b)  # a copy of this plan touches it: wait for the fence
            done.append(b)
        if done:
            self._release_device(done)

    def _ref_device(self, block: int) -> None:
        if self._dev_ref[block] == 0:
            self.dev_cache.unpark(block)
        self._dev_ref[block] += 1

    def _unref_host(self, blocks: list[int]) -> None:
        ref, cache = self._host_ref, self.host_cache
        busy = self._open_host_written or self._open_host_read
        done: list[int] = []
        for h in reversed(blocks) if self.prefix_caching else blocks:  # see _unref_device
            ref[h] -= 1
            if ref[h]:
                continue
            if busy and (h in self._open_host_written or h in self._open_host_read):
                # A copy of this plan touches it: reusable once the plan's copies are done.
                cache.forget(h)
                self._pending_host.setdefault(self._plan().fence, []).append(h)
                continue
            if h in cache.hash_of:
                cache.park(h, 0)
                continue
            done.append(h)
        if done:
            self.host.free(done)

    def _ref_host(self, block: int) -> None:
        if self._host_ref[block] == 0:
            self.host_cache.unpark(block)
        self._host_ref[block] += 1

    def _new_host(self, n: int) -> list[int]:
        """n host blocks: free ones first, then the least recently used cached ones."""
        out = self.host.allocate(min(n, self.host.num_free))
        while len(out) < n:
            if not self.host_cache.num_parked:
                raise MemoryError(f"asked for {n} host blocks, {self.num_free_host} free")
            out.append(self.host_cache.evict_oldest())
        for h in out:
            self._host_ref[h] = 1
        return out

    # -- batches in flight --------------------------------------------------------------------
    def begin_execute(self, iteration: int) -> None:
        """The batch of `iteration` is sent to the worker (it reads and writes its blocks)."""
        self._executing.append(iteration)

    def end_execute(self, iteration: int) -> None:
        """That batch is done (or will never touch the pool again): what it held is free."""
        if iteration in self._executing:
            self._executing.remove(iteration)
        for tag in [t for t in self._held if t <= iteration]:
            blocks = self._held.pop(tag)
            self._num_held -= len(blocks)
            self.device.free(blocks)

    @property
    def executing(self) -> list[int]:
        return list(self._executing)

    def _take_held(self, n: int) -> list[int]:
        """n compute-only blocks, those waiting for the oldest batch first."""
        if n > self._num_held:
            raise MemoryError(f"asked for {n} held device blocks, {self._num_held} held")
        out: list[int] = []
        while len(out) < n:
            tag = min(self._held)
            held = self._held[tag]
            out.append(held.pop())
            if not held:
                del self._held[tag]
        self._num_held -= n
        return out

    def complete(self, fence: int) -> None:
        """A transfer batch finished: blocks it held become reusable."""
        self.device.free(self._pending_device.pop(fence, []))
        self.host.free(self._pending_host.pop(fence, []))

    @property
    def pending_fences(self) -> list[int]:
        return sorted(set(self._pending_device) | set(self._pending_host))

    # -- device allocation (check / act) -------------------------------------------------------
    def _opened(self) -> list[int]:
        """Blocks this iteration's rotate-outs release that compute may still use (see top)."""
        if self._open is None or not self.same_iteration_reuse:
            return []
        return self._pending_device.get(self._open.fence, [])

    @property
    def num_free_for_compute(self) -> int:
        """Free device blocks plus the compute-only and parked cached ones (see top)."""
        # num_free, _opened() and num_parked inlined: admission asks this for candidate
        # after candidate.
        n = len(self.device._free) + self._num_held + len(self.dev_cache.parked)
        if self._open is not None and self.same_iteration_reuse:
            n += len(self._pending_device.get(self._open.fence, ()))
        return n

    def _new_device(self, n: int) -> list[int]:
        """n device blocks for compute: free ones, this iteration's rotate-outs (serial
        step), compute-only ones (the worker writes them after the batch in flight), and
        last the least recently used cached ones (their names are forgotten)."""
        if n <= len(self.device._free):  # the common case: free blocks are enough
            new = self.device.allocate(n)
            for b in new:
                self._dev_ref[b] = 1
            return new
        if n > self.num_free_for_compute:
            raise MemoryError(f"asked for {n} device blocks, {self.num_free_for_compute} free")
        new = self.device.allocate(min(n, self.device.num_free))
        opened = self._opened()
        while len(new) < n and opened:
            new.append(opened.pop())
        new += self._take_held(min(n - len(new), self._num_held))
        while len(new) < n:
            new.append(self.dev_cache.evict_oldest())
        for b in new:
            self._dev_ref[b] = 1
        return new

    def _new_swap_in_targets(self, n: int) -> list[tuple[int, bool]]:
        """n device blocks for H2D copies, each (block, late): free ones; cached ones no
        batch in flight may read; then, copied only once the batch in flight is done
        (`TransferPlan.late_swap_in`), compute-only ones and the other cached ones."""
        if n > self.num_free_for_swap_in:
            raise MemoryError(f"asked for {n} device blocks, {self.num_free_for_swap_in} free")
        out = [(b, False) for b in self.device.allocate(min(n, self.device.num_free))]
        cache, executing = self.dev_cache, self._executing
        while len(out) < n:
            oldest = cache.oldest()
            if oldest is None or oldest[1] in executing:
                break  # released later than this one: in flight too
            out.append((cache.evict_oldest(), False))
        out += [(b, True) for b in self._take_held(min(n - len(out), self._num_held))]
        while len(out) < n:
            out.append((cache.evict_oldest(), True))
        for b, _ in out:
            self._dev_ref[b] = 1
        return out

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        return max(0, need - self.num_device_blocks_of(req))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(req, num_new_tokens) <= self.num_free_for_compute

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        """Grow a running request's table to hold its next `num_new_tokens` tokens."""
        self._grow(self.table(req), self.num_new_blocks(req, num_new_tokens))

    def _grow(self, t: BlockTable, n: int) -> None:
        new = self._new_device(n)
        t.device = [*t.device, *new]  # a new list: see BlockTable
        t.host.extend([None] * n)

    def try_grow(self, req: Request, num_new_tokens: int) -> bool:
        """can_allocate + allocate in one call, for a running request (which holds all of
        its blocks on the device; check_integrity checks it): the per-iteration path."""
        t = self._tables.get(req.request_id)
        # Fast path, most decode steps: the tokens fit in the blocks the request holds.
        if t is not None and req.num_computed_tokens + num_new_tokens <= (
            len(t.device) * self.block_size
        ):
            return True
        n = self.num_new_blocks(req, num_new_tokens)  # can_allocate + allocate, asked once
        if n > self.num_free_for_compute:
            return False
        self._grow(self.table(req), n)
        return True

    # -- release ---------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Finished or aborted: every block of the request goes back (fences respected);
        named blocks no one else references stay cached."""
        self._hashes.pop(req.request_id, None)
        t = self._tables.pop(req.request_id, None)
        if t is None:
            return
        self._unref_device([b for b in t.device if b is not None])
        self._unref_host([b for b in t.host if b is not None])

    def drop_to_recompute(self, req: Request) -> None:
        """Forget the request's KV in both tiers; it recomputes from its tokens (a chunk of
        it still in flight writes KV that no longer counts: a new kv_epoch)."""
        self.free(req)
        req.num_computed_tokens = req.num_inflight_tokens = 0
        req.kv_epoch += 1

    # -- prefix caching -------------------------------------------------------------------------
    def _block_hashes(self, req: Request, n: int) -> list[bytes]:
        """The names of (at least) the request's first n full blocks: the request's list
        itself, computed once and kept while it lives (it may be longer than n)."""
        hs = self._hashes.setdefault(req.request_id, [])
        if len(hs) < n:
            bs = self.block_size
            parent = hs[-1] if hs else self._root
            for i in range(len(hs), n):
                parent = chain_hash(parent, req.token_ids_slice(i * bs, (i + 1) * bs))
                hs.append(parent)
        return hs

    def cache_full_blocks(self, req: Request) -> None:
        """Name the request's newly settled full blocks (called when its KV settles)."""
        t = self._tables.get(req.request_id)
        if t is None or not self.prefix_caching:
            return
        synced = min(self.num_synced(req), len(t))
        if t.cached_next >= synced:
            return
        hashes = self._block_hashes(req, synced)
        for i in range(t.cached_next, synced):
            d, h = t.device[i], t.host[i]
            if d is not None:
                self.dev_cache.name(d, hashes[i])
            if h is not None:
                self.host_cache.name(h, hashes[i])
        t.cached_next = synced

    def lookup(self, req: Request) -> PrefixHit:
        """The longest run of the request's leading full blocks found in a tier (the
        device preferred), for a request holding no blocks. At least its last token is
        left to compute: that is where its next token is sampled from."""
        if not self.prefix_caching or req.request_id in self._tables:
            return NO_HIT
        known = req.num_prompt_tokens + req.num_output_tokens
        limit = min(known, req.num_tokens - 1) // self.block_size
        if limit <= 0:
            return NO_HIT
        hashes = self._block_hashes(req, limit)
        dev, host, ref = self.dev_cache.by_hash, self.host_cache.by_hash, self._dev_ref
        hit = PrefixHit()
        for i in range(limit):
            d = dev.get(hashes[i])
            if d is not None:
                hit.blocks.append((True, d))
                hit.device_hits += 1
                hit.shared += int(ref[d] > 0)
                continue
            h = host.get(hashes[i])
            if h is None or h in self._open_host_written:
                break  # (a host block this plan writes cannot be read by it)
            hit.blocks.append((False, h))
            hit.host_hits += 1
        return hit

    def admission(self, req: Request, budget: int) -> tuple[int, int, int]:
        """If the waiting or rotary request were admitted now with a chunk of at most
        `budget` tokens: (tokens to compute, device blocks it takes from the free and
        reclaimable ones, blocks copied in from the host)."""
        t = self._tables.get(req.request_id)
        if t is not None:  # rotary: its whole table comes back
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            reused, shared = self._swap_in_reuse(req)
            return n, self.blocks_for(req.num_computed_tokens + n) - shared, len(t) - reused
        hit = self.lookup(req)
        start = req.num_computed_tokens + hit.num_blocks * self.block_size
        n = min(req.num_tokens - start, budget)
        return n, self.blocks_for(start + n) - hit.shared, hit.host_hits

    def attach_prefix(self, req: Request) -> PrefixHit:
        """Admit a waiting request onto its cached prefix: reference the device hits, copy
        the host hits in (their host copies become the request's), and count them computed."""
        hit = self.lookup(req)
        if not hit.blocks:
            return hit
        plan = self._plan()
        hashes = self._block_hashes(req, hit.num_blocks)
        for on_device, b in hit.blocks:  # first, so that no allocation below evicts them
            (self._ref_device if on_device else self._ref_host)(b)
        targets = iter(self._new_swap_in_targets(hit.host_hits))
        t = self.table(req)
        devs: list[int | None] = []
        for i, (on_device, b) in enumerate(hit.blocks):
            if on_device:
                devs.append(b)
                h = self.host_cache.by_hash.get(hashes[i])
                if h is not None:
                    self._ref_host(h)  # its host copy too: no eager copy needed
                t.host.append(h)
                continue
            d, late = next(targets)
            (plan.late_swap_in if late else plan.swap_in).append((b, d))
            self._open_filling.add(d)
            self._open_host_read.add(b)
            self.dev_cache.name(d, hashes[i])
            devs.append(d)
            t.host.append(b)
        t.device = devs
        t.cached_next = hit.num_blocks
        req.num_computed_tokens = hit.num_blocks * self.block_size
        return hit

    # -- rotation ---------------------------------------------------------------------------
    def _trim(self, req: Request) -> None:
        """Release device blocks beyond the computed tokens (allocated but never written)."""
        t = self.table(req)
        keep = self.blocks_for(req.num_computed_tokens)
        if keep >= len(t.device) and keep >= len(t.host):
            return  # nothing beyond them (most rotate-outs): keep the table as it is
        extra_dev = [b for b in t.device[keep:] if b is not None]
        extra_host = [b for b in t.host[keep:] if b is not None]
        t.device = t.device[:keep]
        del t.host[keep:]
        self._unref_device(extra_dev)
        self._unref_host(extra_host)

    def _host_copy_of(self, req: Request, i: int) -> int | None:
        """A named host copy of the request's synced block i, if the host tier has one."""
        if not self.prefix_caching or i >= self.num_synced(req):
            return None
        return self.host_cache.by_hash.get(self._block_hashes(req, i + 1)[i])

    def _swap_out_needs(self, req: Request) -> tuple[list[int], list[int]]:
        """(blocks a rotate-out copies, blocks it links to a cached host copy instead)."""
        t = self._tables.get(req.request_id)
        if t is None:
            return [], []
        n, host = min(self.blocks_for(req.num_computed_tokens), len(t)), t.host
        if not self.prefix_caching:  # no named host copies to link
            return [i for i in range(n) if host[i] is None], []
        copy: list[int] = []
        link: list[int] = []
        for i in range(n):
            if host[i] is None:
                (copy if self._host_copy_of(req, i) is None else link).append(i)
        return copy, link

    def swap_out_cost(self, req: Request) -> int:
        """Blocks a rotate-out must copy: the computed blocks without a host copy."""
        return len(self._swap_out_needs(req)[0])

    def released_by_preempting(self, req: Request, rotate: bool) -> tuple[int, int]:
        """Preempting the running request: (device blocks it returns — those no one else
        references —, how many of them a rotate-out copies first, busy until the copy ran)."""
        t = self._tables.get(req.request_id)
        if t is None:
            return 0, 0
        ref = self._dev_ref
        freed = sum(1 for d in t.device if d is not None and ref[d] == 1)
        if not rotate:
            return freed, 0
        copy, _ = self._swap_out_needs(req)
        devs = t.device
        return freed, sum(1 for i in copy if (d := devs[i]) is not None and ref[d] == 1)

    def preemption_blocks(self, req: Request, rotate: bool) -> tuple[int, int, int]:
        """swap_out_cost (0 when not rotating) and released_by_preempting in one call, the
        rotate-out's copies worked out once (the admission walk asks it of each victim)."""
        if not rotate:
            return (0, *self.released_by_preempting(req, False))
        t = self._tables.get(req.request_id)
        if t is None:
            return 0, 0, 0
        copy, _ = self._swap_out_needs(req)
        ref, devs = self._dev_ref, t.device
        freed = sum(1 for d in devs if d is not None and ref[d] == 1)
        return len(copy), freed, sum(1 for i in copy if (d := devs[i]) is not None
                                     and ref[d] == 1)

    def swap_in_cost(self, req: Request) -> int:
        """Blocks a swap-in copies: all of them, less those the device tier still caches."""
        t = self._tables.get(req.request_id)
        return 0 if t is None else len(t) - self._swap_in_reuse(req)[0]

    def can_swap_out(self, req: Request) -> bool:
        return self._host_room_for(req, *self._swap_out_needs(req))

    def _host_room_for(self, req: Request, copy: list[int], link: list[int]) -> bool:
        if not copy:
            return True
        # Linking a parked host copy takes it out of the blocks a copy may evict.
        parked = self.host_cache.parked
        linked = sum(1 for i in link if self._host_copy_of(req, i) in parked)
        return len(copy) <= self.num_free_host - linked

    def try_swap_out(self, req: Request) -> tuple[int, int] | None:
        """can_swap_out + swap_out in one call (None: no room in the host pool), for the
        scheduler's preemptions."""
        needs = self._swap_out_needs(req)
        if not self._host_room_for(req, *needs):
            return None
        # Without prefix caching the copies depend only on which computed blocks lack a
        # host copy, which trimming the blocks past them does not change; with it, they
        # are worked out again after the trim, as swap_out does.
        return self._swap_out(req, None if self.prefix_caching else needs)

    def swap_out(self, req: Request) -> tuple[int, int]:
        """Rotate out: (blocks copied D2H, blocks freed with no copy thanks to eager copies
        or a cached host copy). Blocks another request references stay where they are."""
        return self._swap_out(req, None)

    def _swap_out(self, req: Request,
                  needs: tuple[list[int], list[int]] | None) -> tuple[int, int]:
        plan = self._plan()
        self._trim(req)
        t = self.table(req)
        copy, link = self._swap_out_needs(req) if needs is None else needs
        for i in link:
            h = self._host_copy_of(req, i)
            self._ref_host(h)  # type: ignore[arg-type]
            t.host[i] = h
        synced = self.num_synced(req)
        pending = self._pending_device.setdefault(plan.fence, [])
        sole: list[int] = []
        # Per block copied: kept lean (a rotate-out copies a dozen or more).
        devs, hosts, ref, caching = t.device, t.host, self._dev_ref, self.prefix_caching
        pairs, busy, written = plan.swap_out, self._open_busy, self._open_host_written
        named = self.dev_cache.hash_of  # nothing below names a device block
        for i, h in zip(copy, self._new_host(len(copy)), strict=True):
            d = devs[i]
            assert d is not None
            hosts[i] = h
            pairs.append((d, h))
            busy.add(d)
            written.add(h)
            if caching and i < synced:
                self.host_cache.name(h, self._block_hashes(req, i + 1)[i])
            if ref[d] == 1:
                # Reusable once the copy has read it; its device name goes (the host has it).
                if named:
                    self.dev_cache.forget(d)
                ref[d] = 0
                pending.append(d)
            else:
                sole.append(d)  # others hold it: only this reference goes
        copied = set(copy)
        rest = [d for i, d in enumerate(devs) if d is not None and i not in copied]
        self._unref_device(sole + rest)
        t.device = [None] * len(devs)
        return len(copy), len(rest)

    @property
    def num_free_for_swap_in(self) -> int:
        """Blocks a swap-in may target: free ones, cached ones, and the compute-only ones
        (its copy then waits for the batch in flight: `TransferPlan.late_swap_in`)."""
        return self.device.num_free + self._num_held + self.dev_cache.num_parked

    @property
    def caches_device_blocks(self) -> bool:
        """Does the device tier name blocks a swap-in may reuse (prefix caching)? Where it
        does not, a rotary request's admission takes and copies in its whole table."""
        return bool(self.dev_cache.hash_of)

    def _swap_in_reuse(self, req: Request) -> tuple[int, int]:
        """A rotary request's synced blocks the device tier still caches: (how many, how
        many of those a live request references)."""
        t = self._tables.get(req.request_id)
        if t is None or not self.dev_cache.hash_of:
            return 0, 0
        synced = min(self.num_synced(req), len(t))
        if synced <= 0:
            return 0, 0
        hashes = self._block_hashes(req, synced)
        dev, ref = self.dev_cache.by_hash, self._dev_ref
        reused = shared = 0
        for i in range(synced):
            d = dev.get(hashes[i])
            if d is not None:
                reused += 1
                shared += int(ref[d] > 0)
        return reused, shared

    def can_swap_in(self, req: Request, num_new_tokens: int = 1) -> bool:
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        return need - self._swap_in_reuse(req)[1] <= self.num_free_for_swap_in

    def swap_in(self, req: Request) -> int:
        """Rotate in: copy every block H2D (but those the device tier still caches); keep
        host copies of synced blocks valid. Returns the blocks reused without a copy."""
        plan = self._plan()
        t = self.table(req)
        n = len(t)
        synced = self.num_synced(req)
        reuse: dict[int, int] = {}
        hashes: list[bytes] = []
        if self.prefix_caching and min(synced, n) > 0:
            hashes = self._block_hashes(req, min(synced, n))[:min(synced, n)]
            for i, name in enumerate(hashes):
                cached = self.dev_cache.by_hash.get(name)
                if cached is not None:
                    reuse[i] = cached
                    self._ref_device(cached)  # before the allocation below can evict it
        targets = iter(self._new_swap_in_targets(n - len(reuse)))
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
            self._open_filling.add(d)
            self._open_host_read.add(h)
            if i >= synced:
                # The dirty last block will change: its host copy is stale from now on,
                # and reusable once this copy has read it.
                self._host_ref[h] = 0
                self._pending_host.setdefault(plan.fence, []).append(h)
                t.host[i] = None
            elif hashes:
                self.dev_cache.name(d, hashes[i])
            devs.append(d)
        t.device = devs
        return len(reuse)

    # -- eager rotation ------------------------------------------------------------------------
    def eager_copy(self, running: list[Request], budget: int, host_reserve: int) -> int:
        """Queue background D2H copies of synced blocks lacking a host copy.

        Oldest-computed blocks first, at most `budget` blocks, never taking the host pool
        below `host_reserve` free blocks (rotations need room more than eager copies do).
        A block whose host copy the host tier already caches (a shared prefix) links it
        instead: an eager copy of a shared block happens once.
        """
        plan = self._plan()
        n, bs, tables = 0, self.block_size, self._tables
        caching = self.prefix_caching
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
            hashes = self._block_hashes(req, synced) if caching else None
            for i in range(t.eager_next, synced):
                if n >= budget or self.num_free_host <= host_reserve:
                    return n
                d = t.device[i]
                if t.host[i] is None and d is not None:
                    cached = self.host_cache.by_hash.get(hashes[i]) if hashes else None
                    if cached is not None:
                        self._ref_host(cached)
                        t.host[i] = cached
                    elif hashes and d in self._open_filling:
                        break  # its contents arrive in this plan: copy it next time
                    else:
                        (h,) = self._new_host(1)
                        t.host[i] = h
                        plan.eager.append((d, h))
                        self._open_busy.add(d)
                        self._open_host_written.add(h)
                        if hashes:
                            self.host_cache.name(h, hashes[i])
                        n += 1
                t.eager_next = i + 1
        return n

    # -- integrity ---------------------------------------------------------------------------
    def check_integrity(self, requests: dict[str, Request]) -> None:
        """Raise if any block is leaked, referenced more or less often than counted, reused
        while referenced, named inconsistently, or out of step with request state."""
        for tier, alloc, pending, col, refs, cache in (
            ("device", self.device, self._pending_device, "device", self._dev_ref,
             self.dev_cache),
            ("host", self.host, self._pending_host, "host", self._host_ref, self.host_cache),
        ):
            owner: dict[int, str] = {}
            count: dict[int, int] = {}
            for rid, t in self._tables.items():
                for b in getattr(t, col):
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
            if tier == "device":
                for tag, blocks in self._held.items():
                    for b in blocks:
                        if b in owner:
                            raise AssertionError(f"device block {b} held for batch {tag} "
                                                 f"yet owned by {owner[b]}")
                        if b in cache.hash_of:
                            raise AssertionError(f"device block {b} held yet named")
                        owner[b] = f"batch {tag}"
                if sum(map(len, self._held.values())) != self._num_held:
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
        for rid, t in self._tables.items():
            req = requests.get(rid)
            if req is None:
                raise AssertionError(f"table for unknown request {rid}")
            if len(t.device) != len(t.host):
                raise AssertionError(f"{rid}: device/host table lengths differ")
            need = self.blocks_for(req.num_computed_tokens)
            if req.state is RequestState.RUNNING:
                if any(b is None for b in t.device) or len(t) < need:
                    raise AssertionError(f"{rid} running without all its device blocks")
            elif req.state is RequestState.ROTARY:
                if any(b is not None for b in t.device) or any(h is None for h in t.host[:need]):
                    raise AssertionError(f"{rid} rotary but KV not wholly on the host")
            else:
                raise AssertionError(f"{rid} in state {req.state} still holds blocks")
            synced = self.num_synced(req)
            for i in range(synced, len(t)):
                if t.host[i] is not None and req.state is RequestState.RUNNING:
                    raise AssertionError(f"{rid}: dirty block {i} has a (stale) host copy")
            # A named block holds exactly the KV its name says: the request's own tokens.
            named = [i for i in range(len(t))
                     if t.device[i] in self.dev_cache.hash_of
                     or t.host[i] in self.host_cache.hash_of]
            if named and max(named) >= synced:
                raise AssertionError(f"{rid}: named block {max(named)} is not synced "
                                     f"({synced} are)")
            hashes = self._block_hashes(req, max(named) + 1) if named else []
            for i in named:
                for b, cache in ((t.device[i], self.dev_cache), (t.host[i], self.host_cache)):
                    if b is not None and b in cache.hash_of and cache.hash_of[b] != hashes[i]:
                        raise AssertionError(f"{rid}: block {i} shares KV of other tokens")

    # -- recovery after a peer lost memory (DESIGN §6) -------------------------------------
    def drop_fences(self) -> None:
        """Release every pending fence: a pool that restarted has no copy in flight."""
        for fence in self.pending_fences:
            self.complete(fence)

    def forget_lost(self, *, device: bool = False, host: bool = False,
                    bad_device: set[int] | None = None, bad_host: set[int] | None = None) -> None:
        """A peer lost memory: forget the names of blocks whose contents may be gone (a whole
        tier, or the blocks a failed copy wrote), before any request resumes, so that no
        request is ever served them. Unreferenced ones go back to their pool."""
        for lost_all, bad, cache, alloc in ((device, bad_device, self.dev_cache, self.device),
                                            (host, bad_host, self.host_cache, self.host)):
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
        t = self._tables.get(req.request_id)
        return t is not None and any(d in blocks for d in t.device if d is not None)

    def drop_host_copies(self, req: Request, lost: Callable[[int], bool]) -> bool:
        """Forget the request's host copies that `lost` names; True if any was dropped.

        The host blocks go back to the pool once no one references them (their contents
        are garbage, the blocks are not); eager copies restart from the first hole.
        """
        t = self._tables.get(req.request_id)
        if t is None:
            return False
        dropped = [i for i, h in enumerate(t.host) if h is not None and lost(h)]
        for i in dropped:
            h = t.host[i]
            assert h is not None
            self.host_cache.forget(h)
            self._unref_host([h])
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
        t = self._tables.get(req.request_id)
        if t is None:
            return 0
        limit = min(len(t), self.blocks_for(req.num_computed_tokens))
        k = 0
        while k < limit and t.host[k] is not None:
            k += 1
        self._unref_device([d for d in t.device if d is not None])
        self._unref_host([h for h in t.host[k:] if h is not None])
        del t.host[k:]
        t.device = [None] * k
        t.eager_next = min(t.eager_next, k)
        t.cached_next = min(t.cached_next, k)
        if k == 0:
            del self._tables[req.request_id]
        return k

    def in_iteration(self) -> bool:
        """Between begin_iteration() and end_iteration()?"""
        return self._open is not None
