"""DuplexKV: the engine that moves KV blocks between the device pool and the host pool.

Both pools are block-first tensors `[num_blocks, num_layers, 2, block_size, kv_heads,
head_dim]` (DESIGN §2). A plan (scheduler_svc.block_manager.TransferPlan) carries three
lists of block pairs: urgent swap-outs (device, host), swap-ins (host, device) and
background eager copies (device, host). Modes (`Mode`):

* `layer-first` — the vLLM 0.6 baseline, emulated over the block-first tensors: per layer,
  per K/V, per block, one copy of one segment (`2 * num_layers` small copies per block).
* `block-first` — coalesced runs of whole blocks; swap-outs, then swap-ins, then eager
  copies, one after the other on one lane.
* `duplex` (default) — device->host and host->device at the same time, one lane per
  direction: a worker thread on a CPU (the copies release the GIL), a CUDA stream on a GPU.

Priorities: eager copies run on the D2H lane after the urgent swap-outs of their plan (and
after swap-outs of later plans already queued); the H2D lane never waits for them.

Completion: `submit(plan)` returns a TransferHandle, `wait(handle)` the plan's
TransferTiming once every copy of the plan is done — only then may the scheduler
`complete_transfer(plan.fence)`. `transfer(plan)` does both.

Races: a plan means what running its D2H copies, then its H2D copies, in one thread means.
The two directions run at once, so a swap-in that depends on a D2H copy of its own plan — it
writes a device block a swap-out/eager copy reads, or reads a host block one writes — would
race. The block manager's fences never produce one (they did until a device block lent to
compute from the open fence and trimmed in the same iteration was sent back to the open
fence instead of the free list), so by default the engine refuses such a plan with
TransferConflict: a regression shows up as an error, not as corrupt KV. With
`strict=False` those swap-ins run after the plan's D2H copies, on the D2H lane, and are
counted (`TransferTiming.ordered_blocks`). Two copies writing one block are always refused.
Between plans still in flight (`submit` without `wait`), a plan that would touch a block an
earlier plan writes, or write one it reads, first waits for that earlier plan.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from functools import partial

import structlog
import torch

from common.contracts import TransferPlan
from kvmem_svc.cpu_copy import copy_runs, copy_segments, memmove_ok
from kvmem_svc.cuda_copy import CudaCopier, PendingStep
from kvmem_svc.layout import PoolGeometry, coalesce

log = structlog.get_logger()

SWAP_OUT, SWAP_IN, EAGER = "swap_out", "swap_in", "eager"
SWAP_IN_ORDERED = "swap_in_ordered"  # swap-ins that must follow their plan's D2H copies
_H2D = frozenset({SWAP_IN, SWAP_IN_ORDERED})
# Lower runs first on a lane; equal priorities run in submission order.
_PRIORITY = {SWAP_OUT: 0, SWAP_IN: 0, EAGER: 1, SWAP_IN_ORDERED: 1}
_STOP = 99

Pairs = list[tuple[int, int]]
Step = tuple[str, Pairs]  # (kind, (src, dst) pairs in the step's direction)


class Mode(StrEnum):
    LAYER_FIRST = "layer-first"
    BLOCK_FIRST = "block-first"
    DUPLEX = "duplex"


class TransferConflict(ValueError):
    """A plan whose copies would race with each other (or name blocks that do not exist)."""


class TransferError(RuntimeError):
    """A copy failed; the blocks of the plan are in an unknown state."""


@dataclass(slots=True)
class TransferTiming:
    """What one plan moved and how long it took."""

    fence: int
    mode: str
    block_bytes: int
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    eager_blocks: int = 0
    ordered_blocks: int = 0  # swap-ins that waited for the plan's D2H copies (strict=False)
    copies: int = 0  # copy operations: coalesced runs, or segments for layer-first
    d2h_s: float = 0.0  # busy time of the D2H work (swap-out + eager)
    h2d_s: float = 0.0  # busy time of the swap-ins
    eager_s: float = 0.0  # the eager part of d2h_s
    total_s: float = 0.0  # submit -> last copy done

    @property
    def bytes_d2h(self) -> int:
        return (self.swap_out_blocks + self.eager_blocks) * self.block_bytes

    @property
    def bytes_h2d(self) -> int:
        return self.swap_in_blocks * self.block_bytes

    @property
    def gbps(self) -> float:
        """Bytes moved both ways per second of wall time (1e9 bytes per GB)."""
        return (self.bytes_d2h + self.bytes_h2d) / self.total_s / 1e9 if self.total_s else 0.0

    @property
    def overlap(self) -> float:
        """Busy time of both directions over wall time: above 1 when they ran at once."""
        return (self.d2h_s + self.h2d_s) / self.total_s if self.total_s else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "bytes_d2h": self.bytes_d2h, "bytes_h2d": self.bytes_h2d}


# -- plan checks --------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Footprint:
    """The blocks a plan reads and writes in each tier."""

    dev_read: frozenset[int]  # swap-out and eager sources
    host_write: frozenset[int]  # swap-out and eager destinations
    host_read: frozenset[int]  # swap-in sources
    dev_write: frozenset[int]  # swap-in destinations

    def clashes(self, earlier: Footprint) -> bool:
        """Would running this plan alongside `earlier` race on some block?"""
        return not (
            self.dev_write.isdisjoint(earlier.dev_read)
            and self.dev_write.isdisjoint(earlier.dev_write)
            and self.dev_read.isdisjoint(earlier.dev_write)
            and self.host_write.isdisjoint(earlier.host_read)
            and self.host_write.isdisjoint(earlier.host_write)
            and self.host_read.isdisjoint(earlier.host_write)
        )


@dataclass(slots=True, frozen=True)
class CheckedPlan:
    fence: int
    swap_out: Pairs  # (device, host)
    swap_in: Pairs  # (host, device), independent of the plan's D2H copies
    swap_in_ordered: Pairs  # (host, device), each depending on one of the plan's D2H copies
    eager: Pairs  # (device, host)
    footprint: Footprint


def check_plan(plan: TransferPlan, num_device_blocks: int, num_host_blocks: int,
               strict: bool = True) -> CheckedPlan:
    """Validate a plan against the pools; raise TransferConflict naming the first bad block.

    Swap-ins that depend on the plan's own D2H copies are split off to run after them, or
    refused when `strict`.
    """
    fence = plan.fence

    def norm(pairs: list[tuple[int, int]], what: str, src_n: int, dst_n: int) -> Pairs:
        out = [(int(s), int(d)) for s, d in pairs]
        for col, n, tier in ((0, src_n, "source"), (1, dst_n, "destination")):
            ids = [p[col] for p in out]
            if ids and (min(ids) < 0 or max(ids) >= n):
                bad = next(b for b in ids if not 0 <= b < n)
                raise TransferConflict(
                    f"plan {fence}: {what} {tier} block {bad} out of range (pool has {n} blocks)")
        return out

    swap_out = norm(plan.swap_out, "swap-out", num_device_blocks, num_host_blocks)
    eager = norm(plan.eager, "eager", num_device_blocks, num_host_blocks)
    swap_in = norm(plan.swap_in, "swap-in", num_host_blocks, num_device_blocks)
    d2h = swap_out + eager
    host_writes = [h for _, h in d2h]
    dev_writes = [d for _, d in swap_in]
    for tier, writes in (("host", host_writes), ("device", dev_writes)):
        if len(set(writes)) != len(writes):
            bad = next(b for b, n in Counter(writes).items() if n > 1)
            raise TransferConflict(f"plan {fence}: {tier} block {bad} is written by two copies")
    fp = Footprint(
        dev_read=frozenset(d for d, _ in d2h),
        host_write=frozenset(host_writes),
        host_read=frozenset(h for h, _ in swap_in),
        dev_write=frozenset(dev_writes),
    )
    dev_clash, host_clash = fp.dev_write & fp.dev_read, fp.host_read & fp.host_write
    if strict and dev_clash:
        raise TransferConflict(
            f"plan {fence}: swap-in writes device block {min(dev_clash)} while the same plan's "
            "swap-out/eager copy reads it; the two directions run at the same time, so a "
            "block freed by a swap-out may only be reused after its fence completes")
    if strict and host_clash:
        raise TransferConflict(
            f"plan {fence}: swap-in reads host block {min(host_clash)} while the same plan's "
            "swap-out/eager copy writes it")
    free = [(h, d) for h, d in swap_in if d not in dev_clash and h not in host_clash]
    ordered = [(h, d) for h, d in swap_in if d in dev_clash or h in host_clash]
    return CheckedPlan(fence, swap_out, free, ordered, eager, fp)


# -- handles ------------------------------------------------------------------------------------
class TransferHandle:
    """One submitted plan; `DuplexEngine.wait` turns it into its TransferTiming."""

    def __init__(self, timing: TransferTiming, footprint: Footprint, steps: int) -> None:
        self.fence = timing.fence
        self.timing = timing
        self.footprint = footprint
        self._submitted = time.perf_counter()
        self._remaining = steps
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self._cuda: list[PendingStep] = []
        if steps == 0:
            self._done.set()

    def done(self) -> bool:
        if self._cuda and not self._done.is_set():
            return all(p.end.query() for p in self._cuda)
        return self._done.is_set()

    def _record(self, kind: str, seconds: float, copies: int, error: BaseException | None,
                end: float | None) -> None:
        """One step finished; the last one sets total_s (from `end`, unless None) and done."""
        with self._lock:
            t = self.timing
            if kind in _H2D:
                t.h2d_s += seconds
            else:
                t.d2h_s += seconds
                if kind == EAGER:
                    t.eager_s += seconds
            t.copies += copies
            if error is not None:
                self._errors.append(error)
            self._remaining -= 1
            if self._remaining == 0:
                if end is not None:
                    t.total_s = end - self._submitted
                self._done.set()

    def _resolve_cuda(self) -> None:
        """Block until the streams reach every step's end event; fill the timing from events."""
        with self._resolve_lock:
            if self._done.is_set():
                return
            for p in self._cuda:
                p.end.synchronize()
            ref = self._cuda[0].start
            first = min(ref.elapsed_time(p.start) for p in self._cuda)
            last = max(ref.elapsed_time(p.end) for p in self._cuda)
            self.timing.total_s = (last - first) / 1e3  # GPU-side span, not the caller's wait
            for p in self._cuda:
                self._record(p.kind, p.start.elapsed_time(p.end) / 1e3, p.copies, None, None)


# -- CPU lanes ----------------------------------------------------------------------------------
class _Lane:
    """One direction's worker thread: runs tasks in priority order (urgent before eager)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = (
            queue.PriorityQueue())
        self._seq = itertools.count()
        # The thread holds only the queue: the engine can be collected while it idles.
        self.thread = threading.Thread(target=_serve, args=(self._queue,), name=name, daemon=True)
        self.thread.start()

    def put(self, priority: int, task: Callable[[], None]) -> None:
        self._queue.put((priority, next(self._seq), task))

    def stop(self) -> None:
        self._queue.put((_STOP, next(self._seq), None))  # after everything already queued


def _serve(q: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]]) -> None:
    while True:
        _, _, task = q.get()
        if task is None:
            return
        task()


def _stop_lanes(lanes: dict[str, _Lane]) -> None:
    """Let the lanes finish their queued work and exit; wait for them.

    Also runs at interpreter exit (weakref.finalize): a lane thread still alive during
    finalization can abort the process ("terminate called without an active exception").
    """
    for lane in lanes.values():
        lane.stop()
    for lane in lanes.values():
        if lane.thread is not threading.current_thread():
            lane.thread.join(timeout=30)


def _cpu_step(handle: TransferHandle, kind: str, src: torch.Tensor, dst: torch.Tensor,
              pairs: Pairs, geo: PoolGeometry, layer_first: bool, use_memmove: bool) -> None:
    t0 = time.perf_counter()
    error: BaseException | None = None
    n = 0
    try:
        n = (copy_segments(src, dst, pairs, geo, use_memmove) if layer_first
             else copy_runs(src, dst, coalesce(pairs), geo, use_memmove))
    except Exception as e:  # noqa: BLE001 - reported to the waiter, the lane must live on
        error = e
    t1 = time.perf_counter()
    handle._record(kind, t1 - t0, n, error, t1)


# -- the engine ---------------------------------------------------------------------------------
class DuplexEngine:
    """Transfer engine over one device pool and one host pool (see the module doc)."""

    def __init__(self, device_pool: torch.Tensor, host_pool: torch.Tensor,
                 mode: Mode | str = Mode.DUPLEX, cpu_copy: str = "auto",
                 strict: bool = True) -> None:
        """cpu_copy (CPU pools only): "memmove" (contiguous pools), "torch" (`copy_`, any
        layout; kept for comparison) or "auto" (memmove where it applies).
        strict: refuse plans whose swap-ins depend on their own D2H copies; False runs
        those swap-ins after the D2H copies instead (see top)."""
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise ValueError(f"unknown transfer mode {mode!r}; "
                             f"one of {', '.join(m.value for m in Mode)}") from None
        if device_pool.shape[1:] != host_pool.shape[1:] or device_pool.dtype != host_pool.dtype:
            raise ValueError("device and host pools must share the block shape and dtype")
        if host_pool.device.type != "cpu" or device_pool.device.type not in ("cpu", "cuda"):
            raise ValueError("the host pool lives in host memory; the device pool on cpu or cuda")
        self.geo = PoolGeometry.of(device_pool)
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._cuda = (CudaCopier(device_pool, host_pool, self.geo)
                      if device_pool.device.type == "cuda" else None)
        if cpu_copy not in ("auto", "memmove", "torch"):
            raise ValueError(f"cpu_copy must be auto, memmove or torch, got {cpu_copy!r}")
        if cpu_copy == "memmove" and not memmove_ok(device_pool, host_pool):
            raise ValueError("cpu_copy='memmove' needs contiguous CPU pools")
        self._memmove = cpu_copy != "torch" and memmove_ok(device_pool, host_pool)
        self.strict = strict
        self.ordered_plans = 0  # plans that had swap-ins ordered after their D2H copies
        self._lanes: dict[str, _Lane] = {}
        self._inflight: list[TransferHandle] = []
        self._submit_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop_lanes, self._lanes)

    def describe(self) -> str:
        if self._cuda is not None:
            return f"{self.mode.value}: {self._cuda.describe()}"
        how = "memmove" if self._memmove else "torch copy_"
        lanes = "2 threads" if self.mode is Mode.DUPLEX else "caller's thread"
        return f"{self.mode.value}: cpu, {lanes}, {how}"

    # -- API --------------------------------------------------------------------------------
    def transfer(self, plan: TransferPlan) -> TransferTiming:
        return self.wait(self.submit(plan))

    def submit(self, plan: TransferPlan) -> TransferHandle:
        if not self._finalizer.alive:
            raise RuntimeError("the transfer engine is closed")
        checked = check_plan(plan, self.device_pool.shape[0], self.host_pool.shape[0],
                             self.strict)
        n_ordered = len(checked.swap_in_ordered)
        timing = TransferTiming(
            fence=checked.fence, mode=self.mode.value, block_bytes=self.geo.block_bytes,
            swap_out_blocks=len(checked.swap_out),
            swap_in_blocks=len(checked.swap_in) + n_ordered,
            eager_blocks=len(checked.eager), ordered_blocks=n_ordered,
        )
        if n_ordered:
            self.ordered_plans += 1
            (log.warning if self.ordered_plans == 1 else log.debug)(
                "ordered_transfer", fence=checked.fence, blocks=n_ordered,
                reason="swap-in depends on a D2H copy of the same plan")
        lanes = self._lanes_for(checked)
        with self._submit_lock:
            for earlier in self._inflight:
                if not earlier.done() and checked.footprint.clashes(earlier.footprint):
                    self._settle(earlier)  # its own waiter still sees any error
            self._inflight = [h for h in self._inflight if not h.done()]
            handle = TransferHandle(timing, checked.footprint, sum(map(len, lanes.values())))
            self._start(handle, lanes)
            if not handle.done():
                self._inflight.append(handle)
        return handle

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> TransferTiming:
        """Block until every copy of the handle's plan is done; raise if one failed."""
        self._settle(handle, timeout)
        if handle._errors:
            raise TransferError(
                f"transfer of fence {handle.fence} failed: {handle._errors[0]}"
            ) from handle._errors[0]
        return handle.timing

    def close(self) -> None:
        """Stop the lane threads once their queued work is done (idempotent)."""
        self._finalizer()

    def __enter__(self) -> DuplexEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _lanes_for(self, p: CheckedPlan) -> dict[str, list[Step]]:
        steps = {SWAP_OUT: p.swap_out, SWAP_IN: p.swap_in, EAGER: p.eager,
                 SWAP_IN_ORDERED: p.swap_in_ordered}
        # Ordered swap-ins go last on the lane that holds the plan's D2H copies.
        order = ({"d2h": [SWAP_OUT, EAGER, SWAP_IN_ORDERED], "h2d": [SWAP_IN]}
                 if self.mode is Mode.DUPLEX
                 else {"serial": [SWAP_OUT, SWAP_IN, EAGER, SWAP_IN_ORDERED]})
        lanes = {lane: [(k, steps[k]) for k in kinds if steps[k]] for lane, kinds in order.items()}
        return {lane: s for lane, s in lanes.items() if s}

    def _start(self, handle: TransferHandle, lanes: dict[str, list[Step]]) -> None:
        layer_first = self.mode is Mode.LAYER_FIRST
        if self._cuda is not None:
            for lane, steps in lanes.items():
                handle._cuda += self._cuda.enqueue(
                    lane, [(kind, pairs, kind not in _H2D) for kind, pairs in steps], layer_first)
            return
        for lane, steps in lanes.items():
            for kind, pairs in steps:
                src, dst = ((self.host_pool, self.device_pool) if kind in _H2D
                            else (self.device_pool, self.host_pool))
                args = (handle, kind, src, dst, pairs, self.geo, layer_first, self._memmove)
                if lane == "serial":
                    _cpu_step(*args)
                else:
                    self._lane(lane).put(_PRIORITY[kind], partial(_cpu_step, *args))

    def _lane(self, name: str) -> _Lane:
        if name not in self._lanes:
            self._lanes[name] = _Lane(f"duplexkv-{name}")
        return self._lanes[name]

    def _settle(self, handle: TransferHandle, timeout: float | None = None) -> None:
        if handle._cuda:
            handle._resolve_cuda()
        if not handle._done.wait(timeout):
            raise TimeoutError(f"transfer of fence {handle.fence} still running after {timeout} s")
