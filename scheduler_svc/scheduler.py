"""The engine core: who runs each iteration, which KV blocks move, what the worker computes.

`schedule()` plans one iteration, `update_from_output()` applies its results — the same
code in the service, in `superinfer generate` and in the simulator. One rule for prefill
and decode: a running request's `num_computed_tokens` catches up to its `num_tokens`,
at most `max_batched_tokens` tokens per iteration across all requests (chunked prefill).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.interfaces import ExecuteResult, ScheduledChunk, SchedulerOutput
from scheduler_svc.policy import Policy
from scheduler_svc.policy.base import arrival_order
from scheduler_svc.queue import RequestQueue
from scheduler_svc.request import FinishReason, Request, RequestState


@dataclass(slots=True)
class SchedulerConfig:
    num_device_blocks: int
    num_host_blocks: int = 0
    block_size: int = 16
    max_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 8192
    eager_budget_blocks: int = 32  # background D2H copies per iteration (0: off)
    host_reserve_blocks: int = 0  # eager copies leave this many host blocks free

    def __post_init__(self) -> None:
        if self.num_device_blocks < 1:
            raise ValueError(f"need at least one device block, got {self.num_device_blocks}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be positive")
        if self.num_host_blocks < 0 or self.eager_budget_blocks < 0:
            raise ValueError("block counts must be >= 0")


@dataclass(slots=True)
class SchedulerStats:
    iterations: int = 0
    rotations: int = 0  # rotate-outs to the host pool
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    eager_blocks: int = 0
    freed_without_copy: int = 0  # device blocks released at rotate-out thanks to eager copies
    recomputes: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    decision_s_total: float = 0.0
    decision_s_max: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(slots=True)
class RequestEvent:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class _Plan:
    """Mutable state of one schedule() call."""

    now: float
    budget: int
    tokens: dict[str, int] = field(default_factory=dict)  # request_id -> tokens scheduled
    preempted: bool = False
    xfer_used: int = 0
    out: list[str] = field(default_factory=list)
    into: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    displaced: set[str] = field(default_factory=set)  # preempted this iteration


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.policy = policy
        self.clock = clock
        self.bm = BlockManager(config.num_device_blocks, config.num_host_blocks, config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()
        self.running = RequestQueue()
        self.rotary = RequestQueue()
        self.iteration = 0
        self.stats = SchedulerStats()
        self.finished_log: list[Request] = []  # finished requests not yet collected

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        req.max_model_len = min(req.max_model_len, self.config.max_model_len)
        if req.num_prompt_tokens >= req.max_model_len:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; the limit is {req.max_model_len - 1}"
            )
        need = self.bm.blocks_for(req.num_prompt_tokens + 1)
        if need > self.config.num_device_blocks:
            raise ValueError(
                f"prompt needs {need} KV blocks; the device pool has only "
                f"{self.config.num_device_blocks} (raise --device-blocks)"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, FinishReason.ABORT, self.clock())
        self.stats.aborted += 1
        return True

    def stop(self, request_id: str) -> bool:
        """Finish a request as stopped (a stop string matched upstream, in the text)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, FinishReason.STOP, self.clock())
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.rotary)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.rotary)

    def collect_finished(self) -> list[Request]:
        out, self.finished_log = self.finished_log, []
        return out

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        for queue in (self.waiting, self.running, self.rotary):
            queue.discard(req)
        self.bm.free(req)
        req.finish_reason = reason
        req.set_state(RequestState.FINISHED, now)
        del self.requests[req.request_id]
        self.finished_log.append(req)
        if reason is not FinishReason.ABORT:
            self.stats.finished += 1

    # -- one iteration ------------------------------------------------------------------------
    def complete_transfer(self, fence: int) -> None:
        self.bm.complete(fence)

    def everything_fits(self) -> bool:
        """Would every live request, with its next token, fit in device memory at once?"""
        bs, cap = self.config.block_size, self.config.num_device_blocks
        if len(self.waiting) + len(self.running) + len(self.rotary) > cap:
            return False  # every request needs at least one block
        total = 0
        for q in (self.running, self.rotary, self.waiting):
            for r in q:
                # blocks_for(num_tokens + 1), inlined: this may run over every live request.
                total += (len(r.prompt_token_ids) + len(r.output_token_ids) + bs) // bs
                if total > cap:
                    return False
        return True

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        self.iteration += 1
        plan = _Plan(now=self.clock(), budget=self.config.max_batched_tokens)
        self.bm.begin_iteration()
        fcfs_mode = self.policy.fcfs_when_fits and self.everything_fits()

        order = (
            arrival_order(self.running.list())
            if fcfs_mode
            else self.policy.running_order(self.running.list(), plan.now)
        )
        self._schedule_running(order, plan)
        self._admit(order, plan, fcfs_mode)
        if self.policy.offload and self.config.eager_budget_blocks and self.bm.host.num_blocks:
            self.stats.eager_blocks += self.bm.eager_copy(
                self.running.list(), self.config.eager_budget_blocks,
                self.config.host_reserve_blocks
            )
        transfers = self.bm.end_iteration()
        if transfers is not None:
            self.stats.swap_out_blocks += len(transfers.swap_out)
            self.stats.swap_in_blocks += len(transfers.swap_in)

        chunks = [self._chunk(self.requests[rid], n) for rid, n in plan.tokens.items()]
        # A decode step computes the one token sampled last iteration; anything else
        # (prompt chunks, recompute after preemption) counts as prefill.
        decode = sum(1 for c in chunks if c.sample and c.output_index > 0
                     and len(c.token_ids) == 1 and c.start_pos >= self._prompt_len(c))
        decision = time.perf_counter() - t0
        self.stats.iterations += 1
        self.stats.decision_s_total += decision
        self.stats.decision_s_max = max(self.stats.decision_s_max, decision)
        total = sum(len(c.token_ids) for c in chunks)
        return SchedulerOutput(
            iteration=self.iteration,
            chunks=chunks,
            transfers=transfers,
            num_prefill_tokens=total - decode,
            num_decode_tokens=decode,
            decision_s=decision,
            rotated_out=plan.out,
            rotated_in=plan.into,
            recomputed=plan.recomputed,
        )

    def _schedule_running(self, order: list[Request], plan: _Plan) -> None:
        """Give running requests their tokens; preempt from the tail when blocks run out."""
        bm = self.bm
        for i, req in enumerate(order):
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, plan.budget)
            if n <= 0:
                if plan.budget <= 0:
                    break
                continue
            while not bm.try_grow(req, n):
                victim = next(
                    (v for v in reversed(order[i + 1 :]) if v.state is RequestState.RUNNING),
                    None,
                )
                if victim is None:
                    self._preempt(req, plan)
                    break
                self._preempt(victim, plan)
            if req.state is not RequestState.RUNNING:
                continue
            plan.tokens[req.request_id] = n
            plan.budget -= n

    def _admit(self, order: list[Request], plan: _Plan, fcfs_mode: bool) -> None:
        """Bring waiting and rotary requests in, most deserving first (LVF steps 2–3)."""
        bm, policy, limits = self.bm, self.policy, self.policy.limits
        if plan.budget <= 0 or not (self.waiting or self.rotary):
            return  # nothing to admit, or no token left to give: skip ordering everyone
        if fcfs_mode:
            queue = arrival_order(self.rotary.list() + self.waiting.list())
        else:
            queue = policy.candidates(self.waiting.list(), self.rotary.list(), plan.now)
        victims = [
            r
            for r in reversed(order)
            if r.state is RequestState.RUNNING
            and self.iteration - r.admitted_iteration > limits.min_residency
        ]
        cap = limits.xfer_budget_blocks
        for q in queue:
            if plan.budget <= 0:
                break
            # With every seat taken, a candidate must displace someone (LVF may; FCFS-like
            # policies wait for a seat to free up).
            need_seat = len(self.running) >= self.config.max_num_seqs
            if need_seat and (fcfs_mode or not victims):
                break
            if q.request_id in plan.displaced:
                continue  # taken off the device this iteration: its D2H copy is in flight
            rotary = q.state is RequestState.ROTARY
            if rotary and policy.no_swap_in_after_preemption and plan.preempted:
                continue
            n = min(q.num_tokens - q.num_computed_tokens, plan.budget)
            need = bm.blocks_for(q.num_computed_tokens + n)
            cost = bm.swap_in_cost(q) if rotary else 0
            # A request larger than B_xfer may still move alone, or it would starve.
            if cap is not None and plan.xfer_used and plan.xfer_used + cost > cap:
                break
            chosen = (
                []
                if fcfs_mode
                else self._pick_victims(q, need, rotary, cost, victims, plan, need_seat)
            )
            if chosen is None:
                if policy.skip_unservable and not self._nothing_servable(q, victims, plan):
                    continue  # serve who can be served; q's lag keeps growing meanwhile
                break  # strict order: stop at the first request that cannot be served
            for v in chosen:
                self._preempt(v, plan)
            n = min(q.num_tokens - q.num_computed_tokens, plan.budget)
            need = bm.blocks_for(q.num_computed_tokens + n)
            if need > self._room(rotary) or n <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if rotary:
                bm.swap_in(q)
                plan.xfer_used += cost
                self.rotary.remove(q)
                plan.into.append(q.request_id)
            else:
                self.waiting.remove(q)
            bm.allocate(q, n)  # the chunk's new blocks (a swapped-in request may need one)
            q.set_state(RequestState.RUNNING, plan.now)
            q.run_start_time = plan.now
            q.admitted_iteration = self.iteration
            self.running.append(q)
            plan.tokens[q.request_id] = n
            plan.budget -= n

    def _nothing_servable(self, q: Request, victims: list[Request], plan: _Plan) -> bool:
        """True when no candidate after `q` can be served either: no free block at all, and
        the first eligible victim may not be preempted for `q` — nor, lagging less, for
        anyone after it. Saves walking thousands of waiting requests in vain."""
        if self.bm.num_free_for_compute > 0:
            return False
        v = next((v for v in victims if v.state is RequestState.RUNNING), None)
        return v is None or not self.policy.may_preempt(v, q, plan.now)

    def _room(self, for_swap_in: bool) -> int:
        # A swap-in's H2D copy may not target blocks that a D2H copy of this very iteration
        # still reads; compute may (it writes after the transfers complete).
        return self.bm.num_free_device if for_swap_in else self.bm.num_free_for_compute

    def _pick_victims(
        self,
        q: Request,
        need: int,
        rotary: bool,
        cost: int,
        victims: list[Request],
        plan: _Plan,
        need_seat: bool = False,
    ) -> list[Request] | None:
        """Victims whose preemption makes room for `q` within B_xfer; None if impossible.

        Nobody is preempted unless the candidate then fits: a rotation that does not
        serve anyone only costs transfers.
        """
        bm, policy = self.bm, self.policy
        cap = policy.limits.xfer_budget_blocks
        room, moved, chosen = self._room(rotary), plan.xfer_used + cost, []
        for v in victims:
            if need <= room and (chosen or not need_seat):
                break
            if v.state is not RequestState.RUNNING:
                continue
            if not policy.may_preempt(v, q, plan.now):
                break  # victims come lowest first: later ones may not be preempted either
            out_cost = bm.swap_out_cost(v) if policy.offload else 0
            if cap is not None and moved and moved + out_cost > cap:
                continue
            held = bm.num_device_blocks_of(v)
            # Blocks a rotate-out copies stay busy until the copy ran: usable by compute
            # this iteration, not by a swap-in.
            room += held - out_cost if rotary and policy.offload else held
            moved += out_cost
            chosen.append(v)
        return chosen if need <= room and (chosen or not need_seat) else None

    def _preempt(self, victim: Request, plan: _Plan) -> None:
        """Take a running request off the device: rotate it out, or recompute later."""
        n = plan.tokens.pop(victim.request_id, 0)
        plan.budget += n
        self.running.remove(victim)
        plan.preempted = True
        plan.displaced.add(victim.request_id)
        self.stats.preemptions += 1
        if self.policy.offload and victim.num_computed_tokens > 0 and self.bm.can_swap_out(victim):
            copied, freed = self.bm.swap_out(victim)
            plan.xfer_used += copied
            self.stats.rotations += 1
            self.stats.freed_without_copy += freed
            victim.num_rotations += 1
            victim.set_state(RequestState.ROTARY, plan.now)
            self.rotary.append(victim)
            plan.out.append(victim.request_id)
        else:
            self.bm.drop_to_recompute(victim)
            self.stats.recomputes += 1
            victim.num_recomputes += 1
            victim.set_state(RequestState.WAITING, plan.now)
            self.waiting.append(victim)
            plan.recomputed.append(victim.request_id)

    def _prompt_len(self, chunk: ScheduledChunk) -> int:
        return self.requests[chunk.request_id].num_prompt_tokens

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        s = req.sampling
        return ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids_slice(start, start + n),
            start_pos=start,
            block_table=self.bm.device_block_ids(req),
            sample=start + n == req.num_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            output_index=req.num_output_tokens,
        )

    def update_from_output(self, out: SchedulerOutput, result: ExecuteResult) -> list[RequestEvent]:
        now = self.clock()
        events: list[RequestEvent] = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.state is not RequestState.RUNNING:
                continue  # aborted while the batch ran
            req.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            tok = result.sampled[chunk.request_id]
            req.append_token(tok, now)
            reason = req.check_stop()
            if reason is not None:
                self._finish(req, reason, now)
            events.append(RequestEvent(req.request_id, [tok], reason))
        return events

    def check_integrity(self) -> None:
        self.bm.check_integrity(self.requests)
        states = {
            RequestState.WAITING: self.waiting,
            RequestState.RUNNING: self.running,
            RequestState.ROTARY: self.rotary,
        }
        n = 0
        for state, queue in states.items():
            for r in queue:
                if r.state is not state:
                    raise AssertionError(f"{r.request_id} in {state.value} queue but {r.state}")
                n += 1
        if n != len(self.requests):
            raise AssertionError(f"{len(self.requests)} live requests, {n} queued")
