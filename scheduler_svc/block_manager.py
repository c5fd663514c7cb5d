"""Two-tier KV block manager: device and host block allocators and per-request tables.

Pure Python. A request's KV is a list of logical blocks of `block_size` tokens. Each
logical block may live on the device (a device block id) and may have a valid host copy
(a host block id). Block i is *synced* once its tokens are all computed: its content never
changes again, so a host copy of it stays valid for the request's whole life (DESIGN §3).

`BlockManager` is the API the scheduler, the simulator and the tests call: it keeps the
per-request tables and their check/act pairs (`can_allocate`/`allocate`, `try_grow`,
`free`, `fork`) and hands the rest to one object per concern (scheduler_svc/blocks/):

* `BlockPool` (pool.py) — both tiers, reference counts, fences and batches in flight: when
  a released block may be reused;
* `IterationPlan` (plan.py) — the transfer plan being built and the blocks its copies touch;
* `PrefixIndex` (prefix.py) — block names, prefix lookup and attach, and the rules that
  keep sharing safe (`prefix_caching=True`); every name given or taken goes to a
  `KVEventSink` (kv_events.py; `set_event_sink`, by default nobody);
* `SwapPlanner` (swap.py) — swap-out/in, their costs, eager copies;
* `LossRecovery` (recovery.py) — forgetting what a peer lost;
* `check_integrity` (integrity.py).

A caller that needs one request's blocks gets a `RequestBlocks` (`blocks_of`), a frozen view.

n choices of one prompt (`fork`, scheduler_svc/fork.py) share the leader's full prompt
blocks by the same reference counts, with caching on or off: a follower's table starts
with references to them, so no block is written by two requests and none is freed while
another choice holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from common.contracts import TransferPlan
from scheduler_svc.blocks.allocator import BlockAllocator
from scheduler_svc.blocks.integrity import check_integrity
from scheduler_svc.blocks.plan import IterationPlan
from scheduler_svc.blocks.pool import BlockPool
from scheduler_svc.blocks.prefix import PrefixIndex
from scheduler_svc.blocks.recovery import LossRecovery
from scheduler_svc.blocks.swap import SwapPlanner
from scheduler_svc.blocks.table import BlockTable, RequestBlocks, num_synced
from scheduler_svc.kv_events import KVEventSink
from scheduler_svc.prefix_cache import PrefixHit
from scheduler_svc.request import Request

__all__ = ["BlockAllocator", "BlockManager", "BlockTable", "RequestBlocks"]


class BlockManager:
    """Per-request block tables over a two-tier pool; the scheduler's one door to blocks."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 same_iteration_reuse: bool = True, prefix_caching: bool = False,
                 model_id: str = "") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.same_iteration_reuse = same_iteration_reuse
        self.prefix_caching = prefix_caching
        self._tables: dict[str, BlockTable] = {}
        self._iteration = IterationPlan()
        self.pool = BlockPool(num_device_blocks, num_host_blocks, self._iteration,
                              same_iteration_reuse, prefix_caching)
        self.prefix = PrefixIndex(self.pool, self._tables, block_size, prefix_caching,
                                  model_id)
        self.swaps = SwapPlanner(self.pool, self._tables, self.prefix, block_size)
        self.recovery = LossRecovery(self.pool, self._tables, block_size)
        # The pools' parts that callers (and tests) read directly: the same objects.
        self.device, self.host = self.pool.device, self.pool.host
        self.dev_cache, self.host_cache = self.pool.dev_cache, self.pool.host_cache
        self._dev_ref = self.pool.dev_ref

    @property
    def _open(self) -> TransferPlan | None:
        """The open plan, for tests that compare two managers' states."""
        return self._iteration.plan

    # -- sizes ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device(self) -> int:
        """Free device blocks, the parked cached ones included (reclaimable at once)."""
        return self.pool.num_free_device

    @property
    def num_free_host(self) -> int:
        return self.pool.num_free_host

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

    @property
    def num_used_device(self) -> int:
        """Device blocks some table references (a block shared by several counts once)."""
        return self.pool.num_used_device

    @property
    def num_shared_device(self) -> int:
        """Device blocks more than one table references."""
        return self.pool.num_shared_device

    @property
    def num_free_for_compute(self) -> int:
        """Free device blocks plus the compute-only and parked cached ones (blocks/pool.py)."""
        return self.pool.num_free_for_compute

    @property
    def num_free_for_swap_in(self) -> int:
        """Blocks a swap-in may target: free ones, cached ones, and the compute-only ones
        (its copy then waits for the batch in flight: `TransferPlan.late_swap_in`)."""
        return self.pool.num_free_for_swap_in

    # -- per-request tables ------------------------------------------------------------------
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

    def blocks_of(self, req: Request) -> RequestBlocks:
        """The request's blocks as a frozen view (empty when it holds none)."""
        return RequestBlocks.of(self._tables.get(req.request_id), self.num_synced(req))

    def device_block_ids(self, req: Request) -> list[int]:
        """The request's device block table itself (not a copy): valid until it changes."""
        t = self._tables[req.request_id]
        if None in t.device:
            raise RuntimeError(f"request {req.request_id} is not fully on the device")
        return t.device  # type: ignore[return-value]  # no None in it: checked above

    def num_device_blocks_of(self, req: Request) -> int:
        t = self._tables.get(req.request_id)
        return 0 if t is None else len(t.device) - t.device.count(None)

    def num_synced(self, req: Request) -> int:
        """Full blocks whose KV no batch in flight still writes: their content is final."""
        return num_synced(req, self.block_size)

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
            self.pool.ref_device(d)  # type: ignore[arg-type]  # no None: checked above
        for h in hosts:
            if h is not None:
                self.pool.ref_host(h)
        self._tables[follower.request_id] = BlockTable(
            device=list(devs), host=list(hosts), eager_next=min(src.eager_next, num_blocks),
            cached_next=min(src.cached_next, num_blocks))

    # -- device allocation (check / act) -------------------------------------------------------
    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        return max(0, need - self.num_device_blocks_of(req))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(req, num_new_tokens) <= self.pool.num_free_for_compute

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        """Grow a running request's table to hold its next `num_new_tokens` tokens."""
        self._grow(self.table(req), self.num_new_blocks(req, num_new_tokens))

    def _grow(self, t: BlockTable, n: int) -> None:
        new = self.pool.new_device(n)
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
        if n > self.pool.num_free_for_compute:
            return False
        self._grow(self.table(req), n)
        return True

    # -- release ---------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Finished or aborted: every block of the request goes back (fences respected);
        named blocks no one else references stay cached."""
        self.prefix.forget(req.request_id)
        t = self._tables.pop(req.request_id, None)
        if t is None:
            return
        self.pool.unref_device([b for b in t.device if b is not None])
        self.pool.unref_host([b for b in t.host if b is not None])

    def truncate(self, req: Request) -> None:
        """Speculative rollback: the blocks past the request's computed tokens (they held
        only rejected drafts) go back. Never named nor copied: none of them was synced."""
        t = self._tables.get(req.request_id)
        keep = self.blocks_for(req.num_computed_tokens)
        if t is None or len(t.device) <= keep:
            return
        dev = [b for b in t.device[keep:] if b is not None]
        host = [b for b in t.host[keep:] if b is not None]
        t.device = t.device[:keep]  # a new list: see BlockTable
        del t.host[keep:]
        self.pool.unref_device(dev)
        self.pool.unref_host(host)

    def drop_to_recompute(self, req: Request) -> None:
        """Forget the request's KV in both tiers; it recomputes from its tokens (a chunk of
        it still in flight writes KV that no longer counts: a new kv_epoch)."""
        self.free(req)
        req.num_computed_tokens = req.num_inflight_tokens = 0
        req.kv_epoch += 1

    # -- the iteration's transfer plan, fences, batches in flight ----------------------------
    def begin_iteration(self) -> None:
        self._iteration.begin()

    def end_iteration(self) -> TransferPlan | None:
        """Close the iteration's plan; None when it moves nothing (its fence is released)."""
        plan = self._iteration.close()
        if plan is None:
            return None
        if not plan:
            self.pool.complete(plan.fence)
            return None
        return plan

    def in_iteration(self) -> bool:
        """Between begin_iteration() and end_iteration()?"""
        return self._iteration.plan is not None

    @property
    def num_late_swap_in(self) -> int:
        """Swap-ins of the open plan that must wait for the batch in flight."""
        plan = self._iteration.plan
        return len(plan.late_swap_in) if plan is not None else 0

    def complete(self, fence: int) -> None:
        """A transfer batch finished: blocks it held become reusable."""
        self.pool.complete(fence)

    @property
    def pending_fences(self) -> list[int]:
        return self.pool.pending_fences

    def begin_execute(self, iteration: int) -> None:
        """The batch of `iteration` is sent to the worker (it reads and writes its blocks)."""
        self.pool.begin_execute(iteration)

    def end_execute(self, iteration: int) -> None:
        """That batch is done (or will never touch the pool again): what it held is free."""
        self.pool.end_execute(iteration)

    @property
    def executing(self) -> list[int]:
        return list(self.pool.in_flight)

    # -- prefix caching (blocks/prefix.py) -------------------------------------------------------
    def set_event_sink(self, events: KVEventSink, host_tier: bool = True) -> None:
        """Report every block name given or taken in the device tier, and in the host
        tier unless not `host_tier`, to `events` (KV events for a router:
        scheduler_svc/kv_events.py). Default: nobody is told."""
        self.prefix.set_events(events, host_tier)

    def cache_full_blocks(self, req: Request) -> None:
        """Name the request's newly settled full blocks (called when its KV settles)."""
        self.prefix.cache_full_blocks(req)

    def lookup(self, req: Request) -> PrefixHit:
        """The longest run of the request's leading full blocks cached in a tier, for a
        request holding no blocks (its last token is always left to compute)."""
        return self.prefix.lookup(req)

    def attach_prefix(self, req: Request) -> PrefixHit:
        """Admit a waiting request onto its cached prefix: reference the device hits, copy
        the host hits in (their host copies become the request's), and count them computed."""
        return self.prefix.attach(req)

    @property
    def caches_device_blocks(self) -> bool:
        """Does the device tier name blocks a swap-in may reuse (prefix caching)? Where it
        does not, a rotary request's admission takes and copies in its whole table."""
        return bool(self.dev_cache.hash_of)

    # -- rotation and its costs (blocks/swap.py) ----------------------------------------------
    def admission(self, req: Request, budget: int) -> tuple[int, int, int]:
        """If the waiting or rotary request were admitted now with a chunk of at most
        `budget` tokens: (tokens to compute, device blocks it takes from the free and
        reclaimable ones, blocks copied in from the host)."""
        return self.swaps.admission(req, budget)

    def swap_out_cost(self, req: Request) -> int:
        """Blocks a rotate-out must copy: the computed blocks without a host copy."""
        return self.swaps.swap_out_cost(req)

    def released_by_preempting(self, req: Request, rotate: bool) -> tuple[int, int]:
        """Preempting the running request: (device blocks it returns — those no one else
        references —, how many of them a rotate-out copies first, busy until the copy ran)."""
        return self.swaps.released_by_preempting(req, rotate)

    def preemption_blocks(self, req: Request, rotate: bool) -> tuple[int, int, int]:
        """swap_out_cost (0 when not rotating) and released_by_preempting in one call, the
        rotate-out's copies worked out once (the admission walk asks it of each victim)."""
        return self.swaps.preemption_blocks(req, rotate)

    def swap_in_cost(self, req: Request) -> int:
        """Blocks a swap-in copies: all of them, less those the device tier still caches."""
        return self.swaps.swap_in_cost(req)

    def can_swap_out(self, req: Request) -> bool:
        return self.swaps.can_swap_out(req)

    def try_swap_out(self, req: Request) -> tuple[int, int] | None:
        """can_swap_out + swap_out in one call (None: no room in the host pool), for the
        scheduler's preemptions."""
        return self.swaps.try_swap_out(req)

    def swap_out(self, req: Request) -> tuple[int, int]:
        """Rotate out: (blocks copied D2H, blocks freed with no copy thanks to eager copies
        or a cached host copy). Blocks another request references stay where they are."""
        return self.swaps.swap_out(req)

    def can_swap_in(self, req: Request, num_new_tokens: int = 1) -> bool:
        return self.swaps.can_swap_in(req, num_new_tokens)

    def swap_in(self, req: Request) -> int:
        """Rotate in: copy every block H2D (but those the device tier still caches); keep
        host copies of synced blocks valid. Returns the blocks reused without a copy."""
        return self.swaps.swap_in(req)

    def eager_copy(self, running: list[Request], budget: int, host_reserve: int) -> int:
        """Queue background D2H copies of synced blocks lacking a host copy.

        Oldest-computed blocks first, at most `budget` blocks, never taking the host pool
        below `host_reserve` free blocks (rotations need room more than eager copies do).
        A block whose host copy the host tier already caches (a shared prefix) links it
        instead: an eager copy of a shared block happens once.
        """
        return self.swaps.eager_copy(running, budget, host_reserve)

    # -- integrity and recovery ----------------------------------------------------------------
    def check_integrity(self, requests: dict[str, Request]) -> None:
        """Raise if any block is leaked, referenced more or less often than counted, reused
        while referenced, named inconsistently, or out of step with request state."""
        check_integrity(self.pool, self._tables, self.prefix, requests)

    def drop_fences(self) -> None:
        """Release every pending fence: a pool that restarted has no copy in flight."""
        self.recovery.drop_fences()

    def forget_lost(self, *, device: bool = False, host: bool = False,
                    bad_device: set[int] | None = None, bad_host: set[int] | None = None) -> None:
        """A peer lost memory: forget the names of blocks whose contents may be gone (a whole
        tier, or the blocks a failed copy wrote), before any request resumes, so that no
        request is ever served them. Unreferenced ones go back to their pool."""
        self.recovery.forget_lost(device, host, bad_device, bad_host)

    def has_device_block_in(self, req: Request, blocks: set[int]) -> bool:
        return self.recovery.has_device_block_in(req, blocks)

    def drop_host_copies(self, req: Request, lost: Callable[[int], bool]) -> bool:
        """Forget the request's host copies that `lost` names; True if any was dropped
        (eager copies then restart from the first hole)."""
        return self.recovery.drop_host_copies(req, lost)

    def keep_host_prefix(self, req: Request) -> int:
        """Keep only the request's leading blocks that have a host copy; return how many
        (the rest is released: it resumes by swap-in of those and recompute, DESIGN §6)."""
        return self.recovery.keep_host_prefix(req)
