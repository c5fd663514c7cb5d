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

Shared blocks (n choices of one prompt, `fork`): a device block may have several owners
(`SharedBlocks`); releasing it drops one, and only the last owner's release frees it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.contracts import TransferPlan
from scheduler_svc.request import Request, RequestState
from scheduler_svc.shared_blocks import SharedBlocks


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
        if n > len(self._free):
            raise MemoryError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
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

    def __len__(self) -> int:
        return len(self.device)


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 same_iteration_reuse: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.same_iteration_reuse = same_iteration_reuse
        self.device = BlockAllocator(num_device_blocks)
        self.host = BlockAllocator(num_host_blocks)
        self._tables: dict[str, BlockTable] = {}
        self._pending_device: dict[int, list[int]] = {}
        self._pending_host: dict[int, list[int]] = {}
        self._open: TransferPlan | None = None
        # Device blocks this iteration's D2H copies read. One of them handed to compute and
        # released again before the plan closes must not reach the free list: a swap-in of
        # the same iteration could get it and write it while the D2H copy still reads it.
        self._open_busy: set[int] = set()
        self._next_fence = 1
        self._eager_queue: deque[str] = deque()
        self._executing: list[int] = []  # iterations whose batch is in flight, in order
        self._held: dict[int, list[int]] = {}  # compute-only blocks, by the batch they wait for
        self._num_held = 0
        self._shared = SharedBlocks()

    # -- sizes ---------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device(self) -> int:
        return self.device.num_free

    @property
    def num_free_host(self) -> int:
        return self.host.num_free

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    def device_table(self, request_id: str) -> list[int]:
        """A running request's device block table: the live list (not a copy), every entry
        a device block. Valid until the next block move; copy it to keep it."""
        return self._tables[request_id].device  # type: ignore[return-value]

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
        """Device blocks in use (a block shared by several requests counts once)."""
        return self.device.num_blocks - self.device.num_free

    @property
    def num_shared_device(self) -> int:
        """Device blocks owned by more than one request."""
        return len(self._shared)

    def fork(self, leader: Request, follower: Request, num_blocks: int) -> None:
        """The follower's table starts with the leader's first `num_blocks` device blocks,
        shared (their content must be final: full blocks the leader has settled)."""
        if follower.request_id in self._tables:
            raise RuntimeError(f"{follower.request_id} holds blocks already; it cannot fork")
        src = self._tables[leader.request_id].device[:num_blocks]
        if len(src) < num_blocks or None in src:
            raise RuntimeError(f"{leader.request_id} does not hold {num_blocks} device blocks")
        blocks: list[int] = src  # type: ignore[assignment]  # no None in it: checked above
        self._shared.share(blocks)
        self._tables[follower.request_id] = BlockTable(device=list(blocks), host=[None] * num_blocks)

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
        if plan is None:
            return None
        if not plan:
            self.complete(plan.fence)
            return None
        return plan

    def _plan(self) -> TransferPlan:
        if self._open is None:
            raise RuntimeError("block moves need begin_iteration() first")
        return self._open

    def _release_device(self, blocks: list[int]) -> None:
        """Return device blocks: to the free list; to the open fence if a D2H reads them; or
        compute-only while a batch that may touch them is in flight. A shared block only
        loses an owner."""
        if self._shared:
            blocks = self._shared.unowned(blocks)
        if not self._open_busy and not self._executing:
            self.device.free(blocks)
            return
        for b in blocks:
            if b in self._open_busy:
                self._pending_device[self._plan().fence].append(b)
            elif self._executing:
                self._held.setdefault(self._executing[-1], []).append(b)
                self._num_held += 1
            else:
                self.device.free([b])

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
        """Free device blocks plus the compute-only ones (see top)."""
        return self.device.num_free + len(self._opened()) + self._num_held

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        return max(0, need - self.num_device_blocks_of(req))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(req, num_new_tokens) <= self.num_free_for_compute

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        """Grow a running request's table to hold its next `num_new_tokens` tokens."""
        t = self.table(req)
        n = self.num_new_blocks(req, num_new_tokens)
        if n > self.num_free_for_compute:
            raise MemoryError(f"asked for {n} device blocks, {self.num_free_for_compute} free")
        take = min(n, self.device.num_free)
        new = self.device.allocate(take)
        opened = self._opened()
        while len(new) < n and opened:
            new.append(opened.pop())
        # Compute-only blocks last: the worker writes them after the batch in flight.
        new += self._take_held(n - len(new))
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
        if not self.can_allocate(req, num_new_tokens):
            return False
        self.allocate(req, num_new_tokens)
        return True

    # -- release ---------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Finished or aborted: every block of the request goes back (fences respected)."""
        t = self._tables.pop(req.request_id, None)
        if t is None:
            return
        self._release_device([b for b in t.device if b is not None])
        self.host.free([b for b in t.host if b is not None])

    def drop_to_recompute(self, req: Request) -> None:
        """Forget the request's KV in both tiers; it recomputes from its tokens (a chunk of
        it still in flight writes KV that no longer counts: a new kv_epoch)."""
        self.free(req)
        req.num_computed_tokens = req.num_inflight_tokens = 0
        req.kv_epoch += 1

    # -- rotation ---------------------------------------------------------------------------
    def _trim(self, req: Request) -> None:
        """Release device blocks beyond the computed tokens (allocated but never written)."""
        t = self.table(req)
        keep = self.blocks_for(req.num_computed_tokens)
        extra_dev = [b for b in t.device[keep:] if b is not None]
        extra_host = [b for b in t.host[keep:] if b is not None]
        t.device = t.device[:keep]
        del t.host[keep:]
        self._release_device(extra_dev)
        self.host.free(extra_host)

    def swap_out_cost(self, req: Request) -> int:
        """Blocks a rotate-out must copy: the computed blocks without a host copy."""
        t = self._tables.get(req.request_id)
        if t is None:
            return 0
        keep = self.blocks_for(req.num_computed_tokens)
        return sum(1 for i in range(min(keep, len(t))) if t.host[i] is None)

    def swap_in_cost(self, req: Request) -> int:
        t = self._tables.get(req.request_id)
        return 0 if t is None else len(t)

    def can_swap_out(self, req: Request) -> bool:
        return self.swap_out_cost(req) <= self.host.num_free

    def swap_out(self, req: Request) -> tuple[int, int]:
        """Rotate out: (blocks copied D2H, blocks freed with no copy thanks to eager copies)."""
        plan = self._plan()
        self._trim(req)
        t = self.table(req)
        pending = self._pending_device.setdefault(plan.fence, [])
        copied = freed = 0
        missing = [i for i, h in enumerate(t.host) if h is None]
        to_copy = set(missing)
        hosts = self.host.allocate(len(missing))
        for i, h in zip(missing, hosts, strict=True):
            t.host[i] = h
        for i, d in enumerate(t.device):
            if d is None:
                continue
            if i in to_copy:
                plan.swap_out.append((d, t.host[i]))  # type: ignore[arg-type]
                self._open_busy.add(d)
                copied += 1
                if self._shared.drop(d):
                    continue  # others own it: not freed (nor written, being full)
                pending.append(d)  # reusable once the copy has read it
            else:
                self._release_device([d])
                freed += 1
        t.device = [None] * len(t.device)
        return copied, freed

    @property
    def num_free_for_swap_in(self) -> int:
        """Blocks a swap-in may target: free ones, and the compute-only ones (its copy then
        waits for the batch in flight: `TransferPlan.late_swap_in`)."""
        return self.device.num_free + self._num_held

    def can_swap_in(self, req: Request, num_new_tokens: int = 1) -> bool:
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        return need <= self.num_free_for_swap_in

    def swap_in(self, req: Request) -> int:
        """Rotate in: copy every block H2D; keep host copies of synced blocks valid."""
        plan = self._plan()
        t = self.table(req)
        n = len(t)
        free = min(n, self.device.num_free)
        devs = self.device.allocate(free) + self._take_held(n - free)
        synced = self.num_synced(req)
        for i, d in enumerate(devs):
            h = t.host[i]
            if h is None:
                raise RuntimeError(f"request {req.request_id}: block {i} has no host copy")
            (plan.swap_in if i < free else plan.late_swap_in).append((h, d))
            if i >= synced:
                # The dirty last block will change: its host copy is stale from now on,
                # and reusable once this copy has read it.
                self._pending_host.setdefault(plan.fence, []).append(h)
                t.host[i] = None
        t.device = list(devs)
        return len(devs)

    # -- eager rotation ------------------------------------------------------------------------
    def eager_copy(self, running: list[Request], budget: int, host_reserve: int) -> int:
        """Queue background D2H copies of synced blocks lacking a host copy.

        Oldest-computed blocks first, at most `budget` blocks, never taking the host pool
        below `host_reserve` free blocks (rotations need room more than eager copies do).
        """
        plan = self._plan()
        n, bs, tables = 0, self.block_size, self._tables
        for req in running:
            t = tables.get(req.request_id)
            synced = req.num_settled_tokens // bs  # no batch in flight writes these
            if t is None or t.eager_next >= synced:
                continue  # nothing newly synced (most requests, most iterations)
            synced = min(synced, len(t))
            for i in range(t.eager_next, synced):
                if n >= budget or self.host.num_free <= host_reserve:
                    return n
                d = t.device[i]
                if t.host[i] is None and d is not None:
                    (h,) = self.host.allocate(1)
                    t.host[i] = h
                    plan.eager.append((d, h))
                    n += 1
                t.eager_next = i + 1
        return n

    # -- integrity ---------------------------------------------------------------------------
    def check_integrity(self, requests: dict[str, Request]) -> None:
        """Raise if any block is owned twice, leaked, or out of step with request state."""
        for tier, alloc, pending, col in (
            ("device", self.device, self._pending_device, "device"),
            ("host", self.host, self._pending_host, "host"),
        ):
            owner: dict[int, str] = {}
            owners: dict[int, int] = {}
            for rid, t in self._tables.items():
                for b in getattr(t, col):
                    if b is None:
                        continue
                    owners[b] = owners.get(b, 0) + 1
                    if b in owner:
                        if tier == "device" and owners[b] <= self._shared.owners(b):
                            continue  # shared (fork)
                        raise AssertionError(f"{tier} block {b} owned by {owner[b]} and {rid}")
                    if alloc.is_free(b):
                        raise AssertionError(f"{tier} block {b} of {rid} is on the free list")
                    owner[b] = rid
            if tier == "device":
                wrong = [b for b, n in owners.items() if n != self._shared.owners(b)]
                if wrong or len(self._shared) > sum(1 for n in owners.values() if n > 1):
                    raise AssertionError(f"shared device blocks out of step: {wrong[:5]}")
            for fence, blocks in pending.items():
                for b in blocks:
                    if b in owner:
                        raise AssertionError(f"{tier} block {b} pending on {fence} yet owned")
                    owner[b] = f"fence {fence}"
            if tier == "device":
                for tag, blocks in self._held.items():
                    for b in blocks:
                        if b in owner:
                            raise AssertionError(f"device block {b} held for batch {tag} "
                                                 f"yet owned by {owner[b]}")
                        owner[b] = f"batch {tag}"
                if sum(map(len, self._held.values())) != self._num_held:
                    raise AssertionError("held block count out of step")
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
            for i in range(self.num_synced(req), len(t)):
                if t.host[i] is not None and req.state is RequestState.RUNNING:
                    raise AssertionError(f"{rid}: dirty block {i} has a (stale) host copy")

    # -- recovery after a peer lost memory (DESIGN §6) -------------------------------------
    def drop_fences(self) -> None:
        """Release every pending fence: a pool that restarted has no copy in flight."""
        for fence in self.pending_fences:
            self.complete(fence)

    def has_device_block_in(self, req: Request, blocks: set[int]) -> bool:
        t = self._tables.get(req.request_id)
        return t is not None and any(d in blocks for d in t.device if d is not None)

    def drop_host_copies(self, req: Request, lost: Callable[[int], bool]) -> bool:
        """Forget the request's host copies that `lost` names; True if any was dropped.

        The host blocks go back to the pool (their contents are garbage, the blocks are
        not); eager copies restart from the first hole.
        """
        t = self._tables.get(req.request_id)
        if t is None:
            return False
        dropped = [i for i, h in enumerate(t.host) if h is not None and lost(h)]
        for i in dropped:
            self.host.free([t.host[i]])  # type: ignore[list-item]
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
        self.device.free(self._shared.unowned(d for d in t.device if d is not None))
        self.host.free([h for h in t.host[k:] if h is not None])
        del t.host[k:]
        t.device = [None] * k
        t.eager_next = min(t.eager_next, k)
        if k == 0:
            del self._tables[req.request_id]
        return k

    def in_iteration(self) -> bool:
        """Between begin_iteration() and end_iteration()?"""
        return self._open is not None
