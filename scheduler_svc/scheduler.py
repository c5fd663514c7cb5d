"""The scheduler core: requests in and out, `schedule()` and `update_from_output()`.

`schedule()` plans one iteration, `update_from_output()` applies its results — the same
code in the service, in `superinfer generate` and in the simulator. One rule for prefill
and decode: a running request's `num_computed_tokens` catches up to its `num_tokens`,
at most `max_batched_tokens` tokens per iteration across all requests (chunked prefill).
The decisions — who of the running requests computes, whether to rotate, whom to admit
and whom to preempt — are functions in `policy/` (admission.py, rotation.py, victims.py,
running.py) over `policy/state.py`'s types; this class is the state they read and the
actions they take. The batch is built in batch.py; recovery is recovery.py's mixin.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from common.contracts import ExecuteResult, ScheduledChunk
from scheduler_svc.batch import build_batch, new_prompt_logprobs
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.fork import ForkGroups, shared_blocks
from scheduler_svc.interfaces import SchedulerOutput
from scheduler_svc.policy import Policy
from scheduler_svc.policy.admission import admit as admit_candidates
from scheduler_svc.policy.base import deadline_order
from scheduler_svc.policy.iteration_cost import (
    IterationCost,
    OnlineIterationCost,
    seqs_within,
    tokens_within,
)
from scheduler_svc.policy.merge import merge
from scheduler_svc.policy.priority import classes_first, order_key
from scheduler_svc.policy.running import schedule_running
from scheduler_svc.policy.shares import Ledger
from scheduler_svc.policy.state import Plan, RotationInputs
from scheduler_svc.prefix_cache import PrefixHit
from scheduler_svc.queue import RequestQueue
from scheduler_svc.recovery import Recovery, RecoveryMixin
from scheduler_svc.request import FinishReason, Request, RequestState
from scheduler_svc.scheduler_config import RequestEvent, SchedulerConfig, SchedulerStats
from scheduler_svc.speculative import Speculator
from scheduler_svc.turnover import Turnover

__all__ = ["Recovery", "RequestEvent", "Scheduler", "SchedulerConfig", "SchedulerStats"]


class Scheduler(RecoveryMixin):
    def __init__(
        self,
        config: SchedulerConfig,
        policy: Policy,
        clock: Callable[[], float] = time.monotonic,
        cost: IterationCost | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.clock = clock
        # The executor's time per batch shape, for policies that keep iterations under a
        # time target (iteration-time-aware admission); None: token budget only.
        self.cost = cost
        # The batches a time budget plans are the large ones, where one line fitted over all
        # batches (mostly small decodes) is furthest off: an online fit gets a second one,
        # fitted on the batches that took at least half the target, for the token budget.
        self.near_cost = OnlineIterationCost() if isinstance(cost, OnlineIterationCost) else None
        self._target: float | None = None  # the time target of the last plan, if any
        self.seat_limit = config.max_num_seqs
        self._tbt_slos: dict[float, int] = {}  # S_F of the live requests -> how many
        self._ttft_slos: dict[float, int] = {}  # S_B of the live requests -> how many
        self.bm = BlockManager(config.num_device_blocks, config.num_host_blocks, config.block_size,
                               same_iteration_reuse=not config.pipelined,
                               prefix_caching=config.enable_prefix_caching,
                               model_id=config.model_id)
        self.requests: dict[str, Request] = {}
        # Each queue keeps the policy's groups sorted, so an iteration merges them lazily
        # instead of sorting every live request (policy/base.py); a group per priority
        # class (policy/priority.py).
        self.waiting = RequestQueue(lambda r: order_key(policy, r, False))
        self.running = RequestQueue(policy.running_key if policy.static_running_order else None)
        self.rotary = RequestQueue(lambda r: order_key(policy, r, True))
        self.iteration = 0
        # The tenants' service, for fair shares across them (policy/shares.py).
        self.shares = Ledger(config.fairness, config.num_device_blocks)
        # Speculative decoding (--speculative-config): None where it is off.
        self.speculator = Speculator(config.speculative) if config.speculative else None
        self.stats = SchedulerStats()
        self.finished_log: list[Request] = []  # finished requests not yet collected
        # Planned iterations whose output has not landed: their batches are in flight.
        self._in_flight: dict[int, SchedulerOutput] = {}
        # Device blocks every live request needs for its next token, kept up to date so
        # that `everything_fits` is O(1) (check_integrity recomputes it).
        self._blocks_needed = 0
        self.forks = ForkGroups()  # n > 1: choices waiting for their leader's prompt blocks
        # Finished requests whose sampling state the worker may hold: named on the next batch.
        self._released: list[str] = []
        # Running requests finishing per second: the seats that free up on their own, for a
        # policy that rotates lazily (policy/rotation.py).
        self.turnover = Turnover()

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        req.max_model_len = min(req.max_model_len, self.config.max_model_len)
        if req.num_prompt_tokens >= req.max_model_len:
            cfg = self.config
            pool = cfg.num_device_blocks * cfg.block_size
            why = (f" (the device pool holds {pool} tokens: raise --device-blocks)"
                   if req.max_model_len == pool else "")
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; the limit is "
                f"{req.max_model_len - 1}{why}"
            )
        self.requests[req.request_id] = req
        self.shares.add(req)
        self._blocks_needed += self._next_token_blocks(req)
        self._tbt_slos[req.slo.tbt_s] = self._tbt_slos.get(req.slo.tbt_s, 0) + 1
        n = self._ttft_slos.get(req.slo.ttft_s, 0)
        self._ttft_slos[req.slo.ttft_s] = n + 1
        if not n:
            self._lag_unit_changed()
        self.waiting.append(req)

    def add_group(self, leader: Request, followers: list[Request]) -> None:
        """n choices of one prompt: the followers share the leader's prompt blocks once it
        has computed them (scheduler_svc/fork.py)."""
        self.add_request(leader)
        for f in followers:
            self.add_request(f)
        if followers and shared_blocks(leader, self.config.block_size) > 0:
            self.forks.add(leader, followers)

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
        self.forks.discard(req)
        self.forks.pop(req.request_id)  # its followers compute the prompt themselves
        if req.worker_state_sent:
            self._released.append(req.request_id)
        self.bm.free(req)
        self._blocks_needed -= self._next_token_blocks(req)
        left = self._tbt_slos[req.slo.tbt_s] - 1
        if left:
            self._tbt_slos[req.slo.tbt_s] = left
        else:
            del self._tbt_slos[req.slo.tbt_s]
        left = self._ttft_slos[req.slo.ttft_s] - 1
        if left:
            self._ttft_slos[req.slo.ttft_s] = left
        else:
            del self._ttft_slos[req.slo.ttft_s]
            self._lag_unit_changed()
        req.finish_reason = reason
        req.close_blame(now)
        self.shares.remove(req)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        self.policy.observe_finish(req)
        req.set_state(RequestState.FINISHED, now)
        del self.requests[req.request_id]
        self.finished_log.append(req)
        if reason is not FinishReason.ABORT:
            self.stats.finished += 1
            self.turnover.record(now)
        if not self.requests:
            self.turnover.stop(now)

    # -- one iteration ------------------------------------------------------------------------
    def complete_transfer(self, fence: int) -> None:
        self.bm.complete(fence)

    def everything_fits(self) -> bool:
        """Would every live request, with its next token, fit on the device at once: in
        its memory, and in the seats (max_num_seqs, or fewer where iterations must stay
        under a time target)?"""
        return (self._blocks_needed <= self.config.num_device_blocks
                and len(self.requests) <= self.seat_limit)

    def _lag_unit_changed(self) -> None:
        """Live requests with different TTFT SLOs: the policy counts every lag in the
        longest of them (policy/vlt.py), so that VLT orders them by slack in seconds."""
        slos = self._ttft_slos
        self.policy.set_lag_unit(max(slos) if len(slos) > 1 else None)

    def _time_budget(self) -> int:
        """This iteration's token budget; sets the seat limit. With a time target from the
        policy and a cost model: the tokens whose iteration stays under the target, and
        seats for the decodes that leave the policy's share of it to prefill."""
        cfg, cost = self.config, self.cost
        self.seat_limit = cfg.max_num_seqs
        self._target = None
        if cost is None or not cost.ready or not self._tbt_slos:
            return cfg.max_batched_tokens
        target = self.policy.iteration_target_s(min(self._tbt_slos))
        if target is None:
            return cfg.max_batched_tokens
        if cost.seconds(1, 1, 1) > target / 2:
            # The executor's fixed cost per batch alone takes half the target: fewer requests
            # per batch would cost throughput and win no gap (measured on the CPU stack).
            return cfg.max_batched_tokens
        self._target = target
        near = self.near_cost
        running = self.running
        # sum(num_tokens), the property inlined: this runs every iteration over the batch.
        context = sum(len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_placeholders
                      for r in running)
        budget = tokens_within(near if near is not None and near.ready else cost, target,
                               len(running), context, cfg.max_batched_tokens)
        per_seq = context / len(running) if running else 0.0
        demand = self.policy.prefill_demand(self.waiting.live_groups(), self.clock())
        reserve = min(budget // 2, int(demand * target))
        self.seat_limit = max(1, seqs_within(cost, target, per_seq, cfg.max_num_seqs,
                                              reserve))
        return max(1, budget)

    def _next_token_blocks(self, req: Request) -> int:
        """blocks_for(num_tokens + 1): the request's KV with its next token."""
        return (req.num_tokens + self.config.block_size) // self.config.block_size

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        self.iteration += 1
        plan = Plan(now=self.clock(), budget=self._time_budget())
        self.turnover.start(plan.now)
        self.bm.begin_iteration()
        fcfs_mode = self.policy.plain_fcfs(self.everything_fits())

        if fcfs_mode:
            order = deadline_order(self.running.list())
        elif self.policy.static_running_order:
            order = list(merge(self.running.live_groups(), self.policy.running_merge_key,
                                plan.now))
        else:
            order = self.policy.running_order(self.running.list(), plan.now)
        if self.speculator is not None:
            self.speculator.begin(self.running.list())
        order = classes_first(order)  # victims from the least urgent class first
        order = self.shares.by_tenant(order)  # ... and the tenant most over its share
        schedule_running(self, order, plan)
        admit_candidates(self, order, plan, fcfs_mode)
        if self.policy.uses_host_pool and self.config.eager_budget_blocks and self.bm.num_host_blocks:
            self.stats.eager_blocks += self.bm.eager_copy(
                self.running.list(), self.config.eager_budget_blocks,
                self.config.host_reserve_blocks
            )
        transfers = self.bm.end_iteration()
        if transfers is not None:
            self.stats.swap_out_blocks += len(transfers.swap_out)
            self.stats.swap_in_blocks += len(transfers.swap_in) + len(transfers.late_swap_in)

        if self.shares.accounting:
            bm = self.bm
            self.shares.charge(plan.now, plan.tokens, self.requests,
                               ((r.tenant, bm.num_device_blocks_of(r)) for r in self.running),
                               itertools.chain(self.waiting, self.rotary))
        else:
            self.shares.charge(plan.now, {}, self.requests, ())
        batch = build_batch(plan.tokens, self.requests, self.bm.tables, self.config.block_size,
                            plan.drafts)
        self._blocks_needed += batch.new_blocks_needed
        chunks, decode, epochs = batch.chunks, batch.num_decode_tokens, batch.kv_epochs
        drafted = batch.num_draft_tokens
        decision = time.perf_counter() - t0
        self.stats.iterations += 1
        self.stats.decision_s_total += decision
        self.stats.decision_s_max = max(self.stats.decision_s_max, decision)
        total = sum(plan.tokens.values())  # each chunk has its request's tokens
        out = SchedulerOutput(
            iteration=self.iteration,
            chunks=chunks,
            transfers=transfers,
            num_prefill_tokens=total - decode - drafted,
            num_decode_tokens=decode,
            num_draft_tokens=drafted,
            decision_s=decision,
            num_running=len(self.running),
            rotated_out=plan.out,
            rotated_in=plan.into,
            recomputed=plan.recomputed,
            kv_epochs=epochs,
        )
        if chunks:
            out.released, self._released = self._released, []
            self._in_flight[out.iteration] = out
            self.bm.begin_execute(out.iteration)
        return out

    def _count_prefix_hit(self, req: Request, hit: PrefixHit) -> None:
        """A waiting request was admitted onto a cached prefix (maybe empty): count it."""
        if not self.config.enable_prefix_caching:
            return
        st, bs = self.stats, self.config.block_size
        st.prefix_cache_queries += req.num_tokens
        st.prefix_cache_hits += hit.device_hits * bs
        st.prefix_cache_host_queries += req.num_tokens - hit.device_hits * bs
        st.prefix_cache_host_hits += hit.host_hits * bs
        if req.num_cached_tokens is None:  # the prompt's first admission: what usage reports
            req.num_cached_tokens = hit.num_blocks * bs

    # -- what the decisions in policy/ see and do (policy/state.py's SchedulingState) ---------
    @property
    def blocks(self) -> BlockManager:
        return self.bm

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def pipelined(self) -> bool:
        return self.config.pipelined

    def rotation_inputs(self) -> RotationInputs:
        return RotationInputs(self.policy, len(self.running), self.seat_limit,
                              self.config.block_size, self.turnover.rate)

    def count_growth_preemption(self) -> None:
        self.stats.growth_preemptions += 1

    def count_parked_preemptions(self, n: int) -> None:
        self.stats.parked_preemptions += n

    def admit(self, q: Request, n: int, plan: Plan) -> bool:
        """Seat candidate `q`; False where its swap-in must wait for the batch in flight."""
        bm = self.bm
        late = bm.num_late_swap_in
        if q.state is RequestState.ROTARY:
            self.policy.observe_park(q, plan.now)
            self.stats.swap_in_cached_blocks += bm.swap_in(q)
            self.rotary.remove(q)
            plan.into.append(q.request_id)
        else:
            self.waiting.remove(q)
            self._count_prefix_hit(q, bm.attach_prefix(q))
        # Pipelined, blocks that the batch in flight still holds are filled only after it:
        # computing q in this batch would hold every request in it back for that copy. q
        # computes from the next batch on; the copy runs beside this one.
        deferred = self.config.pipelined and bm.num_late_swap_in > late
        if not deferred:
            bm.allocate(q, n)  # the chunk's new blocks (a swapped-in request may need one)
        q.set_state(RequestState.RUNNING, plan.now)
        q.run_start_time = plan.now
        q.admitted_iteration = self.iteration
        self.running.append(q)
        if deferred:
            self.stats.deferred_swap_ins += 1
        return not deferred

    def preempt(self, victim: Request, plan: Plan) -> None:
        """Take a running request off the device: rotate it out, or recompute later."""
        counted = plan.victim_bound.pop(victim.request_id, None)
        if counted is not None:  # one victim fewer (any it shares blocks with stay bounded)
            plan.releasable[0] -= counted[0]
            plan.releasable[1] -= counted[1]
        n = plan.tokens.pop(victim.request_id, 0)
        plan.budget += n
        self.running.remove(victim)
        plan.preempted = True
        plan.displaced.add(victim.request_id)
        self.stats.preemptions += 1
        moved = (self.bm.try_swap_out(victim)
                 if self.policy.swaps_out(victim) and victim.num_computed_tokens > 0 else None)
        if moved is not None:
            copied, freed = moved
            plan.xfer_used += copied
            self.stats.rotated(victim.tenant)
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

    def update_from_output(self, out: SchedulerOutput, result: ExecuteResult) -> list[RequestEvent]:
        """An iteration's batch ran: its KV is settled and its sampled tokens land."""
        now = self.clock()
        events: list[RequestEvent] = []
        epochs = out.kv_epochs
        caching = self.config.enable_prefix_caching
        if out.chunks and result.execute_s > 0:
            if self.policy.observe_iteration(result.execute_s):
                self.waiting.refile()
                self.rotary.refile()
            if self.speculator is not None and not out.num_prefill_tokens:
                self.speculator.observe(out.num_tokens, result.execute_s)
            if self.cost is not None:
                context = sum(c.start_pos + len(c.token_ids) for c in out.chunks)
                self.cost.observe(out.num_tokens, len(out.chunks), context, result.execute_s)
                if (self.near_cost is not None and self._target is not None
                        and result.execute_s >= 0.5 * self._target):
                    self.near_cost.observe(out.num_tokens, len(out.chunks), context,
                                           result.execute_s)
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue  # finished or aborted while the batch ran
            if chunk.num_draft:
                events.append(self._land_drafts(req, chunk, result,
                                                req.kv_epoch == epochs[chunk.request_id], now))
                continue
            if req.kv_epoch == epochs[chunk.request_id]:
                req.num_inflight_tokens -= len(chunk.token_ids)
                if caching:
                    self.bm.cache_full_blocks(req)  # its settled full blocks get names
            prompt_lps = new_prompt_logprobs(req, chunk, result)
            if self.forks.waiting_for(req.request_id):
                self._fork_followers(req, now)
            if not chunk.sample:
                if prompt_lps:
                    events.append(RequestEvent(req.request_id, [], prompt_logprobs=prompt_lps))
                continue
            tok = result.sampled[chunk.request_id]
            queue = self._queue_of(req)
            if queue is not None:
                # Preempted while its token was in flight: the new last-token time moves it
                # in its queue's order.
                queue.remove(req)
                req.append_token(tok, now)
                queue.append(req)
            else:
                req.append_token(tok, now)
            if self.speculator is not None:
                self.speculator.landed(req.request_id, (tok,))
            reason = req.check_stop()
            if reason is not None:
                self._finish(req, reason, now)
            lp = result.logprobs.get(chunk.request_id)
            events.append(RequestEvent(req.request_id, [tok], reason,
                                       [lp] if lp is not None else None, prompt_lps))
        self._landed(out)
        return events

    def _land_drafts(self, req: Request, chunk: ScheduledChunk, result: ExecuteResult,
                     same_kv: bool, now: float) -> RequestEvent:
        """A speculative chunk landed: its tokens up to the first that ends the request
        are appended, its KV past them is rolled back (scheduler_svc/speculative.py)."""
        rid = req.request_id
        tokens = result.tokens_of(rid)
        assert self.speculator is not None
        self.speculator.verified(rid, chunk.num_draft, len(tokens) - 1)
        before = self._next_token_blocks(req)
        queue = self._queue_of(req)
        if queue is not None:
            queue.remove(req)
        reason = None
        kept = 0
        for tok in tokens:
            req.append_token(tok, now)
            kept += 1
            reason = req.check_stop()
            if reason is not None:
                break
        if queue is not None:
            queue.append(req)
        self._blocks_needed += self._next_token_blocks(req) - before
        if same_kv:
            req.num_inflight_tokens -= len(chunk.token_ids)
            self._roll_back(req, chunk.start_pos + kept)
            if self.config.enable_prefix_caching:
                self.bm.cache_full_blocks(req)
        if reason is not None:
            self._finish(req, reason, now)
        lps = None
        first = result.logprobs.get(rid)
        if first is not None:
            lps = [first, *result.accepted_logprobs.get(rid, ())][:kept]
        return RequestEvent(rid, tokens[:kept], reason, lps)

    def _roll_back(self, req: Request, valid: int) -> None:
        """KV stands for the request's first `valid` tokens (its last known token and the
        drafts that were accepted); the slots of the rejected drafts, and the blocks that
        held only those, go back."""
        req.num_computed_tokens = min(req.num_computed_tokens, valid)
        self.bm.truncate(req)

    def _fork_followers(self, leader: Request, now: float) -> None:
        """The leader's prompt blocks are settled on the device: its followers share them."""
        k = shared_blocks(leader, self.config.block_size)
        if leader.state is not RequestState.RUNNING or leader.num_settled_tokens < k * self.config.block_size:
            return
        for f in self.forks.pop(leader.request_id):
            if f.state is not RequestState.WAITING or f.num_computed_tokens:
                continue
            self.waiting.remove(f)
            self.bm.fork(leader, f, k)
            f.num_computed_tokens = k * self.config.block_size
            f.set_state(RequestState.RUNNING, now)
            f.run_start_time = now
            f.admitted_iteration = self.iteration
            self.running.append(f)

    def load(self) -> dict[str, float]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "rotary": len(self.rotary), "device_blocks_free": self.bm.num_free_device,
                "host_blocks_free": self.bm.num_free_host}

    def set_xfer_budget(self, blocks: int | None) -> None:
        """B_xfer from here on (the engine core's measured link, `--xfer-budget-blocks auto`)."""
        if self.policy.bounded_transfers and blocks != self.policy.limits.xfer_budget_blocks:
            self.policy.limits = dataclasses.replace(self.policy.limits, xfer_budget_blocks=blocks)

    def charge_transfer_stall(self, out: SchedulerOutput, seconds: float) -> None:
        """The worker idled `seconds` before `out`'s batch for its copies (engine_core)."""
        requests = self.requests
        for c in out.chunks:
            req = requests.get(c.request_id)
            if req is not None:
                req.charge_transfer_stall(seconds)

    def _queue_of(self, req: Request) -> RequestQueue | None:
        """The waiting or rotary queue a request sits in (None: running)."""
        if req.state is RequestState.ROTARY:
            return self.rotary
        if req.state is RequestState.WAITING:
            return self.waiting
        return None

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
        needed = sum(self._next_token_blocks(r) for r in self.requests.values())
        if needed != self._blocks_needed:
            raise AssertionError(f"blocks needed: counted {self._blocks_needed}, actual {needed}")
