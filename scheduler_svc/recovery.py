"""Recovery (DESIGN §6): a batch that will never run, or a peer that lost KV memory.

The scheduler owns every request's state, so it alone puts each one where it can resume
from: a lost batch is rolled back (its samples were never published); a lost pool sends
each request back by swap-in of its host-copied prefix, or to recompute. No token a client
has seen is lost or changed. A mixin of `Scheduler` (its state is the scheduler's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.contracts import TransferPlan
from scheduler_svc.interfaces import SchedulerOutput
from scheduler_svc.request import Request, RequestState

if TYPE_CHECKING:
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.queue import RequestQueue
    from scheduler_svc.scheduler_config import SchedulerConfig, SchedulerStats


@dataclass(slots=True)
class Recovery:
    """What kv_lost() did, by request id."""

    kept: list[str] = field(default_factory=list)  # KV intact: carry on running
    swap_in: list[str] = field(default_factory=list)  # rotary: host-copied prefix + recompute
    recompute: list[str] = field(default_factory=list)  # waiting: recompute every token

    def as_dict(self) -> dict[str, int]:
        return {"kept": len(self.kept), "swap_in": len(self.swap_in),
                "recompute": len(self.recompute)}


class RecoveryMixin:
    """`Scheduler`'s recovery methods."""

    bm: BlockManager
    config: SchedulerConfig
    stats: SchedulerStats
    clock: Callable[[], float]
    requests: dict[str, Request]
    waiting: RequestQueue
    running: RequestQueue
    rotary: RequestQueue
    _blocks_needed: int
    _released: list[str]
    # Planned iterations whose output has not landed: their batches are in flight.
    _in_flight: dict[int, SchedulerOutput]

    def _landed(self, out: SchedulerOutput) -> None:
        if self._in_flight.pop(out.iteration, None) is not None:
            self.bm.end_execute(out.iteration)

    @property
    def in_flight(self) -> list[SchedulerOutput]:
        """Planned iterations whose output has not landed, oldest first."""
        return list(self._in_flight.values())

    def abandon_in_flight(self) -> list[SchedulerOutput]:
        """Every batch in flight is lost (a peer failed, and has stopped touching the pool):
        roll them back, newest first. Returns them."""
        lost = self.in_flight
        for out in reversed(lost):
            self.rollback(out)
        return lost

    def rollback(self, out: SchedulerOutput) -> None:
        """The iteration's batch will never run (a peer failed): undo what schedule()
        counted for it. Its samples were never published, so no client saw them."""
        epochs, bs = out.kv_epochs, self.config.block_size
        for chunk in reversed(out.chunks):
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue
            if req.kv_epoch == epochs[chunk.request_id]:
                n = len(chunk.token_ids)
                req.num_inflight_tokens -= n
                req.num_computed_tokens -= n
            if chunk.sample and req.num_placeholders:
                if req.num_tokens % bs == 0:
                    self._blocks_needed -= 1
                req.num_placeholders -= 1
            if chunk.state is not None:
                req.worker_state_sent = False  # that batch may never have reached the worker
        self._released = out.released + self._released
        self._landed(out)

    def kv_lost(
        self, *, device: bool = False, host: bool = False, failed: TransferPlan | None = None
    ) -> Recovery:
        """Put every request where it can resume from after a peer lost KV memory.

        `device`: the worker restarted and its pool is new (every device block is lost).
        `host`: kvmem restarted with a fresh host pool (every host copy is lost).
        `failed`: a transfer batch that failed, so that the blocks it wrote (the host copies
        of its D2H pairs, the device blocks of its swap-ins) may hold anything.

        A running request whose device KV is lost resumes from the longest prefix of its
        blocks that have host copies: ROTARY (swap the prefix in, recompute the rest) or,
        with no such prefix, WAITING (recompute prompt and output tokens). Generated tokens
        are kept, so no token a client has seen is lost or changed. Call it between
        iterations, after the failed batch's fence was released.
        """
        if self.bm.in_iteration():
            raise RuntimeError("kv_lost() runs between iterations; a transfer plan is open")
        self.abandon_in_flight()  # their outputs will never come
        bad_dev = {d for _, d in failed.swap_in + failed.late_swap_in} if failed else set()
        bad_host = {h for _, h in failed.swap_out + failed.eager} if failed else set()
        if device or host:
            self.bm.drop_fences()
        if device:
            # A new worker: no sampling state survives; the next chunks bring it again.
            self._released.clear()
            for req in self.requests.values():
                req.worker_state_sent = False
        # Cached prefixes in lost memory are forgotten before anyone resumes from them.
        self.bm.forget_lost(device=device, host=host, bad_device=bad_dev, bad_host=bad_host)
        lost: Callable[[int], bool] = (lambda h: True) if host else bad_host.__contains__
        now = self.clock()
        rec = Recovery()
        for req in self.running.list():
            self.bm.drop_host_copies(req, lost)
            if device or self.bm.has_device_block_in(req, bad_dev):
                self.running.remove(req)
                self._resume(req, now, rec)
            else:
                rec.kept.append(req.request_id)
        for req in self.rotary.list():
            if self.bm.drop_host_copies(req, lost):
                self.rotary.remove(req)
                self._resume(req, now, rec)
        return rec

    def device_lost(self, failed: TransferPlan | None = None) -> Recovery:
        """The worker restarted: see kv_lost()."""
        return self.kv_lost(device=True, failed=failed)

    def host_lost(self, failed: TransferPlan | None = None) -> Recovery:
        """kvmem restarted: see kv_lost()."""
        return self.kv_lost(host=True, failed=failed)

    def _resume(self, req: Request, now: float, rec: Recovery) -> None:
        """Off the device: rotary from its host-copied prefix, or waiting to recompute."""
        k = self.bm.keep_host_prefix(req)
        computed = req.num_computed_tokens
        req.num_computed_tokens = min(computed, k * self.config.block_size)
        req.num_inflight_tokens = 0
        req.kv_epoch += 1
        if k:
            req.set_state(RequestState.ROTARY, now)
            self.rotary.append(req)
            rec.swap_in.append(req.request_id)
            return
        if computed:
            req.num_recomputes += 1
            self.stats.recomputes += 1
        req.set_state(RequestState.WAITING, now)
        self.waiting.append(req)
        rec.recompute.append(req.request_id)
