"""Both tiers' blocks: allocators, reference counts, parked cached blocks, fences and the
blocks batches in flight may still touch.

Fences: a device block whose content is still being copied to the host is not reusable
until that copy completes, and a host block that is the source of an in-flight copy is not
reusable either. Such blocks sit in `pending_*[fence]` until `complete(fence)`.

One exception, from the serial iteration contract (the step finishes an iteration's
transfers before that iteration executes): a device block freed by this iteration's
rotate-out may be handed to *compute* in the same iteration (the worker writes it only
after the copy has read it), but never to a swap-in, whose H2D copy would run at the same
time as the D2H copy reading it. The pipelined step copies rotate-outs beside the next
execution, so there (`same_iteration_reuse=False`) such a block waits for its fence.

Executes in flight (`begin_execute` / `end_execute`): a device block released while a
batch that may read or write it is still running is *compute-only* (`held`) until that
batch ends. The worker runs batches in order, so the next batch may write it; a swap-in,
whose H2D copy runs beside the batch in flight, may not.

A named block no table references is *parked* in its tier's TierCache (prefix.py has the
rules of sharing): reclaimable, so it counts as free, and evicted least recently used first.
"""

from __future__ import annotations

from scheduler_svc.blocks.allocator import BlockAllocator
from scheduler_svc.blocks.plan import IterationPlan
from scheduler_svc.kv_events import DEVICE_MEDIUM, HOST_MEDIUM
from scheduler_svc.prefix_cache import TierCache


class BlockPool:
    """The device and host pools and every rule about when a block may be reused."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, iteration: IterationPlan,
                 same_iteration_reuse: bool, prefix_caching: bool) -> None:
        self.device = BlockAllocator(num_device_blocks)
        self.host = BlockAllocator(num_host_blocks)
        self.iteration = iteration
        self.same_iteration_reuse = same_iteration_reuse
        self.prefix_caching = prefix_caching
        # References from tables to each block (0: free, pending, held, or parked cached).
        self.dev_ref = [0] * num_device_blocks
        self.host_ref = [0] * num_host_blocks
        self.dev_cache = TierCache(DEVICE_MEDIUM)
        self.host_cache = TierCache(HOST_MEDIUM)
        self.pending_device: dict[int, list[int]] = {}
        self.pending_host: dict[int, list[int]] = {}
        self.in_flight: list[int] = []  # iterations whose batch is in flight, in order
        self.held: dict[int, list[int]] = {}  # compute-only blocks, by the batch they wait for
        self.num_held = 0

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free_device(self) -> int:
        return self.device.num_free + self.dev_cache.num_parked

    @property
    def num_free_host(self) -> int:
        return self.host.num_free + self.host_cache.num_parked

    @property
    def num_free_for_compute(self) -> int:
        """Free device blocks plus the compute-only and parked cached ones (see the top)."""
        # num_free, opened() and num_parked inlined: admission asks this for candidate
        # after candidate.
        n = len(self.device._free) + self.num_held + len(self.dev_cache.parked)
        plan = self.iteration.plan
        if plan is not None and self.same_iteration_reuse:
            n += len(self.pending_device.get(plan.fence, ()))
        return n

    @property
    def num_free_for_swap_in(self) -> int:
        """Blocks a swap-in may target: free ones, cached ones, and the compute-only ones
        (its copy then waits for the batch in flight: `TransferPlan.late_swap_in`)."""
        return self.device.num_free + self.num_held + self.dev_cache.num_parked

    @property
    def num_used_device(self) -> int:
        return sum(1 for r in self.dev_ref if r)

    @property
    def num_shared_device(self) -> int:
        return sum(1 for r in self.dev_ref if r > 1)

    # -- references and release ---------------------------------------------------------------
    def ref_device(self, block: int) -> None:
        if self.dev_ref[block] == 0:
            self.dev_cache.unpark(block)
        self.dev_ref[block] += 1

    def ref_host(self, block: int) -> None:
        if self.host_ref[block] == 0:
            self.host_cache.unpark(block)
        self.host_ref[block] += 1

    def unref_device(self, blocks: list[int]) -> None:
        """Tables drop these references; a block no table references any more is parked
        (named) or released."""
        ref, cache, it = self.dev_ref, self.dev_cache, self.iteration
        done: list[int] = []
        # A table's last blocks are parked first, so evicted first: a prefix's head, which
        # every longer prefix needs, stays longest.
        for b in reversed(blocks) if self.prefix_caching else blocks:
            ref[b] -= 1
            if ref[b]:
                continue
            if b in cache.hash_of:
                if b not in it.busy and b not in it.filling:
                    cache.park(b, self.in_flight[-1] if self.in_flight else 0)
                    continue
                cache.forget(b)  # a copy of this plan touches it: wait for the fence
            done.append(b)
        if done:
            self.release_device(done)

    def release_device(self, blocks: list[int]) -> None:
        """Return unreferenced, unnamed device blocks: to the free list; to the open fence if
        a copy of it touches them; or compute-only while a batch that may touch them is in
        flight."""
        busy, filling = self.iteration.busy, self.iteration.filling
        if not busy and not filling and not self.in_flight:
            self.device.free(blocks)
            return
        free: list[int] = []  # in order, freed at once (a call per block was most of it)
        for b in blocks:
            if b in busy or b in filling:
                self.pending_device.setdefault(self.iteration.get().fence, []).append(b)
            elif self.in_flight:
                self.held.setdefault(self.in_flight[-1], []).append(b)
                self.num_held += 1
            else:
                free.append(b)
        if free:
            self.device.free(free)

    def unref_host(self, blocks: list[int]) -> None:
        it = self.iteration
        ref, cache = self.host_ref, self.host_cache
        busy = it.host_written or it.host_read
        done: list[int] = []
        for h in reversed(blocks) if self.prefix_caching else blocks:  # see unref_device
            ref[h] -= 1
            if ref[h]:
                continue
            if busy and (h in it.host_written or h in it.host_read):
                # A copy of this plan touches it: reusable once the plan's copies are done.
                cache.forget(h)
                self.pending_host.setdefault(it.get().fence, []).append(h)
                continue
            if h in cache.hash_of:
                cache.park(h, 0)
                continue
            done.append(h)
        if done:
            self.host.free(done)

    # -- allocation -------------------------------------------------------------------------
    def new_host(self, n: int) -> list[int]:
        """n host blocks: free ones first, then the least recently used cached ones."""
        out = self.host.allocate(min(n, self.host.num_free))
        while len(out) < n:
            if not self.host_cache.num_parked:
                raise MemoryError(f"asked for {n} host blocks, {self.num_free_host} free")
            out.append(self.host_cache.evict_oldest())
        for h in out:
            self.host_ref[h] = 1
        return out

    def opened(self) -> list[int]:
        """Blocks this iteration's rotate-outs release that compute may still use (see top)."""
        plan = self.iteration.plan
        if plan is None or not self.same_iteration_reuse:
            return []
        return self.pending_device.get(plan.fence, [])

    def new_device(self, n: int) -> list[int]:
        """n device blocks for compute: free ones, this iteration's rotate-outs (serial
        step), compute-only ones (the worker writes them after the batch in flight), and
        last the least recently used cached ones (their names are forgotten)."""
        if n <= len(self.device._free):  # the common case: free blocks are enough
            new = self.device.allocate(n)
            for b in new:
                self.dev_ref[b] = 1
            return new
        if n > self.num_free_for_compute:
            raise MemoryError(f"asked for {n} device blocks, {self.num_free_for_compute} free")
        new = self.device.allocate(min(n, self.device.num_free))
        opened = self.opened()
        while len(new) < n and opened:
            new.append(opened.pop())
        new += self.take_held(min(n - len(new), self.num_held))
        while len(new) < n:
            new.append(self.dev_cache.evict_oldest())
        for b in new:
            self.dev_ref[b] = 1
        return new

    def new_swap_in_targets(self, n: int) -> list[tuple[int, bool]]:
        """n device blocks for H2D copies, each (block, late): free ones; cached ones no
        batch in flight may read; then, copied only once the batch in flight is done
        (`TransferPlan.late_swap_in`), compute-only ones and the other cached ones."""
        if n > self.num_free_for_swap_in:
            raise MemoryError(f"asked for {n} device blocks, {self.num_free_for_swap_in} free")
        out = [(b, False) for b in self.device.allocate(min(n, self.device.num_free))]
        cache, executing = self.dev_cache, self.in_flight
        while len(out) < n:
            oldest = cache.oldest()
            if oldest is None or oldest[1] in executing:
                break  # released later than this one: in flight too
            out.append((cache.evict_oldest(), False))
        out += [(b, True) for b in self.take_held(min(n - len(out), self.num_held))]
        while len(out) < n:
            out.append((cache.evict_oldest(), True))
        for b, _ in out:
            self.dev_ref[b] = 1
        return out

    def take_held(self, n: int) -> list[int]:
        """n compute-only blocks, those waiting for the oldest batch first."""
        if n > self.num_held:
            raise MemoryError(f"asked for {n} held device blocks, {self.num_held} held")
        out: list[int] = []
        while len(out) < n:
            tag = min(self.held)
            held = self.held[tag]
            out.append(held.pop())
            if not held:
                del self.held[tag]
        self.num_held -= n
        return out

    # -- batches in flight and fences ------------------------------------------------------------
    def begin_execute(self, iteration: int) -> None:
        self.in_flight.append(iteration)

    def end_execute(self, iteration: int) -> None:
        if iteration in self.in_flight:
            self.in_flight.remove(iteration)
        for tag in [t for t in self.held if t <= iteration]:
            blocks = self.held.pop(tag)
            self.num_held -= len(blocks)
            self.device.free(blocks)

    def complete(self, fence: int) -> None:
        self.device.free(self.pending_device.pop(fence, []))
        self.host.free(self.pending_host.pop(fence, []))

    @property
    def pending_fences(self) -> list[int]:
        return sorted(set(self.pending_device) | set(self.pending_host))
