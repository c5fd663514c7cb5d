"""The scheduler core: who runs each iteration, which KV blocks move, what the worker computes.

`schedule()` plans one iteration, `update_from_output()` applies its results — the same
code in the service, in `superinfer generate` and in the simulator. One rule for prefill
and decode: a running request's `num_computed_tokens` catches up to its `num_tokens`,
at most `max_batched_tokens` tokens per iteration across all requests (chunked prefill).

A scheduled chunk counts as computed at once, and a chunk that samples adds a placeholder
token, so the next iteration can be planned while this one executes (the pipelined step,
`engine_core.py`): its decodes carry `PLACEHOLDER`, which the worker fills in with the token
it sampled for that request in the batch before. `update_from_output()` then only settles
the chunks and puts the sampled ids in their placeholders' places; `rollback()` undoes an
iteration whose output will never come (a peer failed).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from common.contracts import (
    PLACEHOLDER,
    ExecuteResult,
    ScheduledChunk,
    TokenLogprob,
    TransferPlan,
)
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.fork import ForkGroups, shared_blocks
from scheduler_svc.interfaces import SchedulerOutput
from scheduler_svc.policy import Policy, Unservable
from scheduler_svc.policy.base import deadline_order
from scheduler_svc.policy.iteration_cost import (
    IterationCost,
    OnlineIterationCost,
    seqs_within,
    tokens_within,
)
from scheduler_svc.prefix_cache import PrefixHit
from scheduler_svc.queue import Entry, RequestQueue
from scheduler_svc.request import FinishReason, Request, RequestState
from scheduler_svc.turnover import Turnover


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
    # Planned one iteration ahead, its transfers beside the batch in flight (the pipelined
    # step): blocks of this iteration's rotate-outs are not reused before their copy is done.
    pipelined: bool = False
    # Automatic prefix caching (block_manager.py): full blocks named by their tokens are
    # shared between requests and stay cached in both tiers after their requests end.
    # `model_id` roots the names, so that KV of another model never matches.
    enable_prefix_caching: bool = False
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.num_device_blocks < 1:
            raise ValueError(f"need at least one device block, got {self.num_device_blocks}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be positive")
        if self.num_host_blocks < 0 or self.eager_budget_blocks < 0:
            raise ValueError("block counts must be >= 0")
        # A request must fit the device pool on its own, or once it outgrew it no amount of
        # preemption would let it run (it would preempt itself forever): like vLLM, the
        # context is capped by what the pool holds.
        self.max_model_len = min(self.max_model_len, self.num_device_blocks * self.block_size)


@dataclass(slots=True)
class SchedulerStats:
    iterations: int = 0
    rotations: int = 0  # rotate-outs to the host pool
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    eager_blocks: int = 0
    freed_without_copy: int = 0  # device blocks released at rotate-out thanks to eager copies
    # Prefix cache, in tokens, at each admission of a waiting request (vLLM's counting): the
    # device tier is queried for all of its tokens, the host tier for those the device missed.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_queries: int = 0
    prefix_cache_host_hits: int = 0
    swap_in_cached_blocks: int = 0  # blocks a swap-in found cached on the device: no copy
    # Pipelined: admissions whose swap-ins wait for the batch in flight; they compute from
    # the batch after, so that the one they join does not wait for their copies.
    deferred_swap_ins: int = 0
    recomputes: int = 0
    preemptions: int = 0
    # ... of them, to give a running request the blocks its next tokens need (the rest:
    # for a candidate, by the policy's order)
    growth_preemptions: int = 0
    # ... and to seat a parked (rotary) request: a started request traded for another, which
    # buys the parked one its pace (TPOT) with the victim's stalled gap (per-gap TBT)
    parked_preemptions: int = 0
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
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    # Echo: logprobs of the prompt tokens after those already published, in order.
    prompt_logprobs: list[TokenLogprob] | None = None


class Rotation(NamedTuple):
    """What Scheduler._rotation_needed found: whether to rotate this iteration, the
    candidates in the order to try them, the parked ones that go first (admission holds
    blocks for them), the slack under which a parked candidate may preempt (None: as
    the policy's may_preempt says), and, while it may not yet, the device blocks each
    running request grows into before the next request is expected to finish: a parked
    candidate comes back into free blocks only where they also cover that growth."""

    needed: bool
    queue: Iterable[Request]
    hold: frozenset[str]
    parked_within_s: float | None
    growth_blocks_per_seat: float = 0.0


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
    reserve: int = 0  # free device blocks admission leaves for running requests to grow
    # Per victim, for this iteration's admission walk (it asks about the same victims for
    # candidate after candidate): (blocks a rotate-out copies, device blocks preempting it
    # releases, how many of those the copy keeps busy, whether those two stay valid).
    victim_blocks: dict[str, tuple[int, int, int, bool]] = field(default_factory=dict)
    victim_head: int = 0  # victims before this index are off the device already
    # Upper bounds on the device blocks that preempting every victim still running would
    # release, (for compute, for a swap-in), kept up to date as victims go and their exact
    # blocks become known; per victim, what it adds (empty: not counted yet). A candidate
    # needing more beyond the free room cannot be served: no victim walk needed.
    releasable: list[int] = field(default_factory=lambda: [0, 0])
    victim_bound: dict[str, tuple[int, int]] = field(default_factory=dict)


class Scheduler:
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
        self._seat_limit = config.max_num_seqs
        self._tbt_slos: dict[float, int] = {}  # S_F of the live requests -> how many
        self._ttft_slos: dict[float, int] = {}  # S_B of the live requests -> how many
        self.bm = BlockManager(config.num_device_blocks, config.num_host_blocks, config.block_size,
                               same_iteration_reuse=not config.pipelined,
                               prefix_caching=config.enable_prefix_caching,
                               model_id=config.model_id)
        self.requests: dict[str, Request] = {}
        # Each queue keeps the policy's groups sorted, so an iteration merges them lazily
        # instead of sorting every live request (policy/base.py).
        self.waiting = RequestQueue(lambda r: policy.order_key(r, False))
        self.running = RequestQueue(policy.running_key if policy.static_running_order else None)
        self.rotary = RequestQueue(lambda r: policy.order_key(r, True))
        self.iteration = 0
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
        # policy that rotates lazily (_rotation_needed).
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
                and len(self.requests) <= self._seat_limit)

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
        self._seat_limit = cfg.max_num_seqs
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
        self._seat_limit = max(1, seqs_within(cost, target, per_seq, cfg.max_num_seqs,
                                              reserve))
        return max(1, budget)

    def _next_token_blocks(self, req: Request) -> int:
        """blocks_for(num_tokens + 1): the request's KV with its next token."""
        return (req.num_tokens + self.config.block_size) // self.config.block_size

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        self.iteration += 1
        plan = _Plan(now=self.clock(), budget=self._time_budget())
        self.turnover.start(plan.now)
        self.bm.begin_iteration()
        fcfs_mode = self.policy.plain_fcfs(self.everything_fits())

        if fcfs_mode:
            order = deadline_order(self.running.list())
        elif self.policy.static_running_order:
            order = list(_merge(self.running.live_groups(), self.policy.running_merge_key,
                                plan.now))
        else:
            order = self.policy.running_order(self.running.list(), plan.now)
        self._schedule_running(order, plan)
        self._admit(order, plan, fcfs_mode)
        if self.policy.uses_host_pool and self.config.eager_budget_blocks and self.bm.num_host_blocks:
            self.stats.eager_blocks += self.bm.eager_copy(
                self.running.list(), self.config.eager_budget_blocks,
                self.config.host_reserve_blocks
            )
        transfers = self.bm.end_iteration()
        if transfers is not None:
            self.stats.swap_out_blocks += len(transfers.swap_out)
            self.stats.swap_in_blocks += len(transfers.swap_in) + len(transfers.late_swap_in)

        chunks, decode, epochs = self._chunks(plan)
        decision = time.perf_counter() - t0
        self.stats.iterations += 1
        self.stats.decision_s_total += decision
        self.stats.decision_s_max = max(self.stats.decision_s_max, decision)
        total = sum(plan.tokens.values())  # each chunk has its request's tokens
        out = SchedulerOutput(
            iteration=self.iteration,
            chunks=chunks,
            transfers=transfers,
            num_prefill_tokens=total - decode,
            num_decode_tokens=decode,
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

    def _schedule_running(self, order: list[Request], plan: _Plan) -> None:
        """Give running requests their tokens; preempt from the tail when blocks run out."""
        try_grow, running, tokens = self.bm.try_grow, RequestState.RUNNING, plan.tokens
        tables, bs = self.bm.tables, self.config.block_size
        # Per running request per iteration: kept lean (it dominates the decision's cost):
        # num_tokens inlined, the budget in a local (preemption changes plan.budget), and
        # try_grow's fast path (the tokens fit the blocks it holds: most decode steps).
        budget = plan.budget
        last = len(order) - 1
        for i, req in enumerate(order):
            if req.state is not running:
                continue  # preempted earlier in this loop
            placeholders = req.num_placeholders
            if placeholders and req.finishes_when_outputs_land:
                continue  # its last token is being sampled; nothing left to compute
            computed = req.num_computed_tokens
            n = len(req.prompt_token_ids) + len(req.output_token_ids) + placeholders - computed
            if n > 1 and n > budget - (last - i):
                # A chunk leaves a token for each running request after it: a decode left
                # out of the batch misses its gap (two iterations) for a prompt chunk that
                # only moves a TTFT (measured: half of LVF's missed gaps at gh200-96gb, 20
                # req/s, were decodes behind prefill chunks in the 512-token budget).
                n = budget - (last - i)
            if n > budget:
                n = budget
            if n <= 0:
                if budget <= 0:
                    break
                continue
            rid = req.request_id
            t = tables.get(rid)
            if (t is None or computed + n > len(t.device) * bs) and not try_grow(req, n):
                plan.budget = budget
                while not try_grow(req, n):
                    victim = next((v for v in reversed(order[i + 1 :]) if v.state is running),
                                  None)
                    self.stats.growth_preemptions += 1
                    if victim is None:
                        self._preempt(req, plan)
                        break
                    self._preempt(victim, plan)
                budget = plan.budget
                if req.state is not running:
                    continue
            tokens[rid] = n
            budget -= n
        plan.budget = budget

    LAZY_SCAN = 256  # candidates _rotation_needed looks at, at most
    # Lazy only where at least this many requests finished within the candidate's TTFT
    # SLO: the rate is then known to ~25 % (which lazy_margin covers), and seats free up
    # often enough to wait for. The CPU stack at 0.546 req/s (~3 finishes per 10 s) always
    # rotates as LVF did: there, lazy rotation measured 69 % TTFT against 82 % in
    # back-to-back real-stack passes (docs/results/rotasched/). At 1.5x its saturation
    # today (4.32 req/s, ~26 finishes per 10 s) lazy rotation is on there too
    # (docs/results/rotasched/).
    LAZY_MIN_FINISHES = 16
    # A parked request coming back early leaves room for growth until the next finish
    # only where at least this many finished within its TTFT SLO: fewer (a run's first
    # seconds) read as a rate too low for the steady state (_rotation_needed).
    GROWTH_MIN_FINISHES = 4

    def _rotation_needed(self, queue: Iterator[Request], now: float, chunk_tokens: int = 0
                         ) -> Rotation:
        """Would an on-time candidate miss its deadline waiting for the seats that running
        requests free by finishing? The k-th candidate in the policy's order gets one of
        those in about k / rate seconds; where every candidate's slack (policy.slack_s)
        covers that, no rotation is needed this iteration: admission only fills free
        blocks. Returns the answer and the queue (the candidates looked at put back).

        A rotation costs its victim a stalled gap, parked seconds; rotating for a candidate
        with seconds of slack, that seats would have freed for anyway, only costs gaps.
        Measured in the simulator (docs/results/rotasched/): LVF rotated for candidates at their
        arrival (p50 TTFT 0.2-0.4 s against a 5 s SLO) and missed ~1 gap per rotation,
        while waiting-first, rotating later, kept 99.9 % of gaps at gh200 defaults. The
        wait is a mean: a candidate also keeps `lazy_margin` of its TTFT SLO to spare (at
        0, Mixtral at 60 req/s admitted them at the last moment, p50 TTFT 4.4 s of 5: TPOT
        79.9 -> 71.3 %, goodput 24.5 -> 21.6 req/s; at 0.25, 78.9 % and 24.5).

        Where more requests run than the seat limit allows (the time budget's seat count
        fell below the running count), the first of them to finish free no seat: the k-th
        candidate waits for k plus that excess. Counting k alone, LVF waited for seats
        that were not coming (measured in the simulator, mixed SLO classes on gh200 at 20
        req/s: 177 running against 156 seats, interactive requests with 0.6 s of their 1 s
        SLO left were told a seat frees in 0.05 s, waited 0.7-0.9 s and missed). And a
        new candidate's slack leaves one batch for its prompt (vlt.deadline); a prompt
        longer than the tokens this batch leaves for prompts (`chunk_tokens`) spends a
        batch per further chunk of it (`policy.prompt_batches_s`): at 155 prompt tokens a
        batch, a 1,024-token interactive prompt admitted with 0.26 s left took 7 batches
        and missed its 1 s SLO (the same run).

        Only new requests' deadlines make rotation needed, not parked ones': a parked
        request ranks behind new ones until its VLT overtakes theirs, so a rotation for
        it seated a new request at the head and parked one more running request, whose
        own deadline then asked for the next (measured on the real stack at 1.5x
        saturation: every rotation past the first seconds came from a parked request 7-10
        places back, and LVF parked 56-81 requests for seconds while its p99 TTFT stayed
        at 3.7-5 s of a 10 s SLO; docs/results/rotasched/). A parked
        request comes back as its VLT rises, or into free blocks.

        Where no rotation is needed, the same estimate says how many more seats the new
        candidates can spare: the k-th, with slack s, can wait (s − margin)·rate − k seats
        more. With `parked_first`, that many parked candidates (the least of those spares,
        in the policy's order) go ahead of every new one: a parked request that streamed
        is stalled, a new one still has time (measured on the real stack at 1.5x
        saturation, where swapped-first met every TTFT: LVF seated new requests with 8-9 s
        of their 10 s left while parked ones waited, 97 % of its per-gap misses' time
        parked). Returns the answer, the queue (the candidates looked at put back, those
        parked ones first) and the ids of the parked ones that went first: admission holds the
        blocks for them rather than seat a new request past them.

        Where too few requests finish to wait for (LAZY_MIN_FINISHES), every candidate may
        rotate, except that a parked one, as above, does not trigger rotation: it preempts
        only once its slack is under `lazy_margin` of its TTFT SLO (`parked_within_s`), and
        until then comes back into free blocks. Measured on the real stack with long chat
        replies (docs/results/rotasched/: 100 requests at 0.855 req/s,
        ~7 finishes per 10 s SLO): 203 of LVF's 315 rotations were a parked request taking
        the seat of a running one with more slack, which a rotation later took back, one
        missed gap each; waiting-first rotated 106 times and beat LVF's per-gap TBT.
        Coming back into free blocks before then, a parked request takes them only where
        they also hold what the running requests (it among them) grow by until the next
        finish frees blocks: `limits.growth_room` (a half) of 1/(rate · time between
        tokens · block size) blocks each (`growth_blocks_per_seat`). Without it the
        running set grew into the blocks a resume had just taken, and a growth
        preemption parked someone else, one missed gap
        each (the same passes: 78-168 growth preemptions against waiting-first's 55-79).
        With it (the real stack, seed 11, 1.5x and 2x): 21 and 21 growth
        preemptions against 82 and 22 without and waiting-first's 64 and 65; per-gap TBT
        99.70 / 99.65 % against 99.36 / 99.68 and waiting-first's 99.50 / 99.49; seeds 12
        and 13: 38-54 against waiting-first's 79-117, per-gap TBT 99.54-99.64 against
        99.32-99.49, the best goodput in all four passes. But room for the whole growth
        left blocks idle: the long replies LVF had parked came back one at a time once the
        arrivals stopped, its output tokens per second fell under the baselines', and its
        makespan, which vLLM's goodput divides by, grew (seed 15 at 1.5x: 132 tok/s against
        156-159, 52.8 s past the last arrival against 22-25, goodput 0.557 against
        waiting-first's 0.624). Half of it (docs/results/rotasched/, "Half the room to
        grow"): in the CPU twin's replay of ten real passes, goodput +2.4-7 % in every cell,
        the claim in 10 of 10 (a quarter: 8; none: LVF's per-gap TBT fell under
        waiting-first's); on the real stack 0.628 against 0.587 in that cell, where the
        claim now holds, and better in 4 of 5 cells (+0.03-0.05), worse in 1 (-0.04). Under
        GROWTH_MIN_FINISHES in the SLO the rate is not trusted, and no room is kept."""
        seen: list[Request] = []
        needed = False
        rotary = RequestState.ROTARY
        rate = None
        margin = self.policy.limits.lazy_margin
        spare = math.inf  # seats every new candidate looked at can still wait for
        parked: list[Request] = []  # on-time parked candidates looked at (parked_first)
        parked_first = self.policy.limits.parked_first
        k = 0
        over = max(0, len(self.running) - self._seat_limit)  # finishes that free no seat
        for q in queue:
            seen.append(q)
            if q.fork_of is not None:
                continue
            slack = self.policy.slack_s(q, now)
            if slack is None:  # late: it preempts nobody, nor do those after it
                break
            if rate is None:
                rate = self.turnover.rate(now, q.slo.ttft_s)
                finishes = rate * q.slo.ttft_s  # within the candidate's TTFT SLO
                if finishes < self.LAZY_MIN_FINISHES:
                    # Too few seats free on their own to wait for: rotate for every
                    # candidate, a parked one only near its deadline (docstring).
                    gap, bs = self.policy.gap_s, self.config.block_size
                    growth = (self.policy.limits.growth_room / (rate * gap * bs)
                              if finishes >= self.GROWTH_MIN_FINISHES and gap else 0.0)
                    return Rotation(True, itertools.chain(seen, queue), frozenset(),
                                    margin * q.slo.ttft_s, growth)
            k += 1
            # A parked candidate takes a seat before those behind it, but its own slack
            # triggers no rotation (the docstring's last paragraph).
            if q.state is rotary:
                if parked_first:
                    parked.append(q)
            else:
                if len(q.prompt_token_ids) > chunk_tokens > 0:  # (most prompts: one batch)
                    slack -= self.policy.prompt_batches_s(q, chunk_tokens)
                s = (slack - margin * q.slo.ttft_s) * rate - k - over
                if s < 0.0:
                    needed = True
                    break
                if s < spare:
                    spare = s
            if k >= self.LAZY_SCAN:
                break
        if needed or not parked or spare < 1.0:
            return Rotation(needed, itertools.chain(seen, queue), frozenset(), None)
        first = parked if spare >= len(parked) else parked[:int(spare)]
        ahead = frozenset(q.request_id for q in first)
        rest = [q for q in seen if q.request_id not in ahead]
        return Rotation(needed, itertools.chain(first, rest, queue), ahead, None)

    def _admit(self, order: list[Request], plan: _Plan, fcfs_mode: bool) -> None:
        """Bring waiting and rotary requests in, most deserving first (LVF steps 2–3)."""
        bm, policy, limits = self.bm, self.policy, self.policy.limits
        if plan.budget <= 0 or not (self.waiting or self.rotary):
            return  # nothing to admit, or no token left to give: skip ordering everyone
        queue: Iterable[Request]
        if fcfs_mode:
            queue = deadline_order(self.rotary.list() + self.waiting.list())
        else:
            runs = policy.candidate_runs(self.waiting.groups() + self.rotary.groups(), plan.now)
            queue = _merge(runs, policy.merge_key, plan.now)
        rotate = not fcfs_mode
        hold: frozenset[str] = frozenset()  # parked ones that go first (_rotation_needed)
        parked_within: float | None = None  # a parked one preempts only under this slack
        growth_per_seat = 0.0  # ... and until then leaves this many free blocks per seat
        if rotate and limits.lazy_rotation and policy.lazy_rotation:
            rotate, queue, hold, parked_within, growth_per_seat = self._rotation_needed(
                iter(queue), plan.now, plan.budget)
        # Preemption victims, lowest first: past their minimum residency (FCFS-like
        # iterations, and lazy ones that need no rotation, preempt nobody for a candidate).
        it, residency, running = self.iteration, limits.min_residency, RequestState.RUNNING
        rotary_state = RequestState.ROTARY  # (an Enum member lookup is slow: a local)
        victims = [] if not rotate else [
            r for r in reversed(order)
            if r.state is running and it - r.admitted_iteration > residency
        ]
        cap = limits.xfer_budget_blocks
        bs = self.config.block_size
        plan.reserve = 0 if fcfs_mode else policy.growth_reserve_blocks(len(self.running), bs)
        # Whether the seat limit is the iteration-time budget's (below max_num_seqs): with
        # every seat taken, the seat a candidate needs is then one the budget holds back.
        budget_seats = self._seat_limit < self.config.max_num_seqs
        free_only = False
        fits_waiting: int | None = None  # while free_only: see _free_fits
        fits_rotary: int | None = None
        # The tokens a parked candidate not yet due may need at most to fit the blocks it
        # may take (_early_fits; None: not worked out since the last admission or
        # preemption): tens of them per iteration are each too large for those blocks.
        fits_early: int | None = None
        tables = bm.tables
        for q in queue:
            if q.fork_of is not None:
                continue  # one of n choices, waiting for its leader's prompt blocks
            if free_only:
                # Fast skip: once nobody may be preempted, walking on only looks for a
                # candidate that fits the free blocks (often hundreds of candidates deep).
                # It needs blocks_for(min(num_tokens, computed + budget)) > room blocks,
                # i.e. both of those over room * block_size tokens (num_tokens inlined).
                fits = fits_rotary if q.state is rotary_state else fits_waiting
                if fits is None or (
                        len(q.prompt_token_ids) + len(q.output_token_ids) + q.num_placeholders
                        > fits and q.num_computed_tokens + plan.budget > fits):
                    continue
            if plan.budget <= 0:
                break
            # With every seat taken, a candidate must displace someone (LVF may; FCFS-like
            # policies wait for a seat to free up).
            need_seat = len(self.running) >= self._seat_limit
            policy.time_bound = need_seat and budget_seats  # for may_preempt
            if need_seat and (fcfs_mode or not victims):
                break
            if q.request_id in plan.displaced:
                continue  # taken off the device this iteration: its D2H copy is in flight
            rotary = q.state is RequestState.ROTARY
            if rotary and not policy.may_swap_in(q, plan.preempted):
                continue
            early = (rotary and parked_within is not None
                     and not self._parked_must_preempt(q, plan.now, parked_within))
            if early and not free_only:
                # Fast skip, the same outcome as the walk below: a parked candidate not
                # yet due takes only a free seat and blocks it fits in (the tests inlined
                # as in the free_only skip; cost: its whole table, nothing reused).
                if fits_early is None:
                    fits_early = self._early_fits(plan, growth_per_seat)
                if fits_early >= 0 and (need_seat or (
                        len(q.prompt_token_ids) + len(q.output_token_ids) + q.num_placeholders
                        > fits_early and q.num_computed_tokens + plan.budget > fits_early)):
                    if cap is not None and plan.xfer_used and (
                            plan.xfer_used + len(tables[q.request_id]) > cap):
                        break
                    continue
            # Tokens to compute, blocks taken, blocks copied in (a cached prefix counts).
            n, need, cost = bm.admission(q, plan.budget)
            swaps_in = rotary or cost > 0  # an H2D copy fills some of its blocks
            # A request larger than B_xfer may still move alone, or it would starve.
            if cap is not None and plan.xfer_used and plan.xfer_used + cost > cap:
                break
            if free_only or early:
                # Nobody may be preempted (any more, or for this parked candidate yet):
                # only free blocks serve; a parked one not yet due leaves the running
                # requests room to grow until the next finish (_rotation_needed).
                if need_seat and free_only:
                    break
                reserve = plan.reserve
                if early:
                    reserve += math.ceil((len(self.running) + 1) * growth_per_seat)
                if need_seat or need > self._room(swaps_in, reserve):
                    continue
                chosen: list[Request] | None = []
            elif fcfs_mode:
                chosen = []
            else:
                # As many victims as q's seat takes: the seat limit can drop below the
                # running count (a slower batch, more prefill demand), and one victim then
                # seated nobody, a batch after batch (measured, docs/results/rotasched/).
                seats = len(self.running) - self._seat_limit + 1
                chosen = self._pick_victims(q, need, swaps_in, cost, victims, plan, seats)
            if chosen is None:
                if q.request_id in hold:
                    break  # its blocks free up for it first, not for a new request past it
                if policy.on_unservable(q, plan.now) is Unservable.STOP:
                    break  # strict order: stop at the first request that cannot be served
                # Serve who can be served; q's lag keeps growing meanwhile.
                if self._may_preempt_for(q, victims, plan):
                    continue
                # Nobody may be preempted for q, nor (lagging less) for anyone after it.
                if self._free_below_least(plan):
                    break
                free_only = True
                fits_waiting, fits_rotary = self._free_fits(plan)
                continue
            if rotary:
                self.stats.parked_preemptions += len(chosen)
            for v in chosen:
                self._preempt(v, plan)
            fits_early = None  # blocks and seats change below (or the walk ends)
            n, need, cost = bm.admission(q, plan.budget)
            if (need > self._room(rotary or cost > 0, plan.reserve) or n <= 0
                    or len(self.running) >= self._seat_limit):
                break
            plan.xfer_used += cost
            late = bm.num_late_swap_in
            if rotary:
                policy.observe_park(q, plan.now)
                self.stats.swap_in_cached_blocks += bm.swap_in(q)
                self.rotary.remove(q)
                plan.into.append(q.request_id)
            else:
                self.waiting.remove(q)
                self._count_prefix_hit(q, bm.attach_prefix(q))
            # Pipelined, blocks that the batch in flight still holds are filled only after
            # it: computing q in this batch would hold every request in it back for that
            # copy. q computes from the next batch on; the copy runs beside this one.
            deferred = self.config.pipelined and bm.num_late_swap_in > late
            if not deferred:
                bm.allocate(q, n)  # the chunk's new blocks (a swapped-in request may need one)
            q.set_state(RequestState.RUNNING, plan.now)
            q.run_start_time = plan.now
            q.admitted_iteration = self.iteration
            self.running.append(q)
            if deferred:
                self.stats.deferred_swap_ins += 1
                continue
            plan.tokens[q.request_id] = n
            plan.budget -= n
            if free_only:
                if self._free_below_least(plan):
                    break
                fits_waiting, fits_rotary = self._free_fits(plan)

    def _early_fits(self, plan: _Plan, growth_per_seat: float) -> int:
        """For _admit's fast skip of parked candidates not yet due: the tokens such a
        candidate may need at most to fit the blocks it may take (those that leave the
        running requests room to grow, _rotation_needed); -1 where that test is not exact
        (a device block cache: a swap-in may reuse cached blocks, bm.admission)."""
        if self.bm.caches_device_blocks:
            return -1
        reserve = plan.reserve + math.ceil((len(self.running) + 1) * growth_per_seat)
        return max(0, self._room(True, reserve)) * self.config.block_size

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

    def _parked_must_preempt(self, q: Request, now: float, within_s: float) -> bool:
        """May parked `q` preempt where seats are not waited for (_rotation_needed)? Only
        with less slack than `within_s`, or none it counts on (slack_s None: late, which
        preempts nobody anyway, or past the catch-up it counts on but not late)."""
        slack = self.policy.slack_s(q, now)
        return slack is None or slack < within_s

    def _may_preempt_for(self, q: Request, victims: list[Request], plan: _Plan) -> bool:
        """May the first eligible victim be preempted for `q`? When not, no later victim
        may be (they come lowest first), nor for any later candidate (lagging less)."""
        head = _first_running(victims, plan)
        return head < len(victims) and self.policy.may_preempt(victims[head], q, plan.now)

    def _free_below_least(self, plan: _Plan) -> bool:
        """Are the free blocks fewer than the smallest candidate needs? Then walking the
        rest of thousands of candidates would serve nobody."""
        free = self.bm.num_free_for_compute - plan.reserve
        if free <= 0:
            return True
        sizes = [n for n in (self.waiting.min_tokens(), self.rotary.min_tokens()) if n]
        # The least any candidate can need: its whole context, or a budget-sized chunk.
        return free < self.bm.blocks_for(min([*sizes, plan.budget]))

    def _free_fits(self, plan: _Plan) -> tuple[int | None, int | None]:
        """While nobody may be preempted: the tokens a waiting and a rotary candidate may
        need at most to fit the free blocks (room · block_size); None where no request of
        that queue fits, so that the walk passes them over (hundreds of rotary requests
        each holding more KV than the few free blocks) without a look at each."""
        bs, budget = self.config.block_size, plan.budget
        out: list[int | None] = []
        for queue, swap_in in ((self.waiting, False), (self.rotary, True)):
            room = self._room(swap_in, plan.reserve)
            fits, least = room * bs, queue.min_tokens()
            # A rotary request holds KV: it needs a block at least. Any request needs more
            # than `fits` where its num_tokens and computed + budget both exceed it.
            none_fits = (swap_in and room <= 0) or (
                least is not None and least > fits and budget > fits)
            out.append(None if none_fits else fits)
        return out[0], out[1]

    def _room(self, for_swap_in: bool, reserve: int = 0) -> int:
        # A swap-in's H2D copy may not target blocks that a D2H copy of this very iteration
        # still reads; compute may (it writes after the transfers complete).
        free = self.bm.num_free_for_swap_in if for_swap_in else self.bm.num_free_for_compute
        return free - reserve

    def _pick_victims(
        self,
        q: Request,
        need: int,
        rotary: bool,
        cost: int,
        victims: list[Request],
        plan: _Plan,
        seats: int = 0,
    ) -> list[Request] | None:
        """Victims whose preemption makes room for `q` within B_xfer, and at least `seats`
        of them (the seats q needs: ≤ 0 where one is free); None if impossible.

        Nobody is preempted unless the candidate then fits: a rotation that does not
        serve anyone only costs transfers.
        """
        bm, policy = self.bm, self.policy
        cap = policy.limits.xfer_budget_blocks
        room, moved = self._room(rotary, plan.reserve), plan.xfer_used + cost
        head = _first_running(victims, plan)
        busy_counts = rotary or not bm.same_iteration_reuse
        chosen: list[Request] = []
        for v in itertools.islice(victims, head, None):
            if need <= room and len(chosen) >= seats:
                break
            if v.state is not RequestState.RUNNING:
                continue
            if not policy.may_preempt(v, q, plan.now):
                break  # victims come lowest first: later ones may not be preempted either
            if not chosen:  # someone may be preempted: would even all of them make room?
                if not plan.victim_bound:
                    self._count_releasable(victims[head:], plan)
                if need > room + plan.releasable[busy_counts]:
                    return None
            out_cost, held, busy = self._victim_blocks(v, plan)
            if cap is not None and moved and moved + out_cost > cap:
                continue
            # Blocks a rotate-out copies stay busy until the copy ran: never usable by a
            # swap-in this iteration, and by compute only in a serial step (see the top of
            # block_manager.py). Blocks another request shares are not released at all.
            room += held - busy if busy_counts else held
            moved += out_cost
            chosen.append(v)
        return chosen if need <= room and len(chosen) >= seats else None

    def _count_releasable(self, victims: list[Request], plan: _Plan) -> None:
        """plan.releasable for the running ones of `victims`: each adds at most every device
        block of its own (of those, a swap-in may not use the ones a rotate-out copies)."""
        bound, tables = plan.victim_bound, self.bm.tables
        running = RequestState.RUNNING
        total = 0
        for v in victims:  # up to the whole batch, once an iteration: kept lean
            if v.state is running:
                t = tables.get(v.request_id)  # bm.num_device_blocks_of, inlined
                n = 0 if t is None else len(t.device) - t.device.count(None)
                bound[v.request_id] = (n, n)
                total += n
        plan.releasable[0] += total
        plan.releasable[1] += total

    def _victim_blocks(self, v: Request, plan: _Plan) -> tuple[int, int, int]:
        """A running request as a victim: (blocks a rotate-out copies, device blocks
        preempting it releases, how many of those the copy keeps busy)."""
        blocks = plan.victim_blocks.get(v.request_id)
        if blocks is None:
            bm, swaps = self.bm, self.policy.swaps_out(v)
            out_cost, held, busy = bm.preemption_blocks(v, swaps)
            # Without prefix caching no reference is added during admission, so a victim
            # that shares no block now releases the same blocks all iteration.
            stable = not bm.prefix_caching and held == bm.num_device_blocks_of(v)
            blocks = plan.victim_blocks[v.request_id] = (out_cost, held, busy, stable)
            counted = plan.victim_bound.get(v.request_id)
            if stable and counted is not None:  # its exact blocks: a tighter bound
                plan.victim_bound[v.request_id] = (held, held - busy)
                plan.releasable[0] += held - counted[0]
                plan.releasable[1] += held - busy - counted[1]
        out_cost, held, busy, stable = blocks
        if not stable:  # a co-owner may have let go of shared blocks since
            held, busy = self.bm.released_by_preempting(v, self.policy.swaps_out(v))
        return out_cost, held, busy

    def _preempt(self, victim: Request, plan: _Plan) -> None:
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

    def _chunks(self, plan: _Plan) -> tuple[list[ScheduledChunk], int, dict[str, int]]:
        """The batch for the worker, and how many of its tokens are decode steps.

        The batch counts as computed (in flight) from now on: each request's chunk is
        advanced as it is built, and a sampling chunk adds its placeholder token. Also
        returns each request's kv_epoch, to settle its chunk against."""
        chunks: list[ScheduledChunk] = []
        decode = 0
        epochs: dict[str, int] = {}
        # bm.device_table inlined (a call per chunk less).
        requests, tables, new_chunk = self.requests, self.bm.tables, ScheduledChunk
        add, bs = chunks.append, self.config.block_size
        for rid, n in plan.tokens.items():  # one per request in the batch: kept lean
            req = requests[rid]
            start = req.num_computed_tokens
            end = start + n
            prompt, output = req.prompt_token_ids, req.output_token_ids
            p = len(prompt)
            known = p + len(output)
            if start >= p:
                ids = output[start - p : end - p]
            else:
                ids = prompt[start:end] if end <= p else prompt[start:] + output[: end - p]
            if end > known:  # the last token is being sampled in flight: the worker has it
                if end > known + 1:
                    raise RuntimeError(f"{rid}: planned past its one token in flight")
                ids.append(PLACEHOLDER)
            placeholders = req.num_placeholders
            sample = end == known + placeholders  # the request's num_tokens
            # A decode step computes the one token sampled last iteration; anything else
            # (prompt chunks, recompute after preemption) counts as prefill.
            if n == 1 and sample and start >= p:
                decode += 1
            s = req.sampling
            # The live table (see ScheduledChunk); a running request holds every block
            # (no None in it: check_integrity checks it).
            chunk = new_chunk(rid, ids, start, tables[rid].device,  # type: ignore[arg-type]
                              sample, s.temperature, s.top_p, s.top_k, s.seed,
                              len(output) + placeholders)
            if req.chunk_extras:
                self._sampling_fields(req, chunk, end)
            add(chunk)
            # In flight from now on (len(ids) == n).
            req.num_computed_tokens = end
            req.num_inflight_tokens += n
            epochs[rid] = req.kv_epoch
            if sample:
                req.num_placeholders = placeholders = placeholders + 1
                if (known + placeholders) % bs == 0:
                    self._blocks_needed += 1  # the next token starts a new block
        return chunks, decode, epochs

    @staticmethod
    def _sampling_fields(req: Request, c: ScheduledChunk, end: int) -> None:
        """What logprobs, echo, penalties, bias and grammar add to a chunk."""
        s = req.sampling
        c.logprobs = -1 if s.logprobs is None else s.logprobs
        p = req.num_prompt_tokens
        if s.prompt_logprobs and c.start_pos < p - 1:
            # Row of position q scores prompt token q + 1; the last prompt token's row
            # samples instead (its logprob is the first output token's).
            c.prompt_logprob_targets = req.prompt_token_ids[c.start_pos + 1 : min(end, p - 1) + 1]
        if c.sample and s.stateful:
            c.stateful = True
            c.presence_penalty = s.presence_penalty
            c.frequency_penalty = s.frequency_penalty
            c.repetition_penalty = s.repetition_penalty
            if not req.worker_state_sent:
                c.state = req.sampling_state()
                req.worker_state_sent = True

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
            if req.kv_epoch == epochs[chunk.request_id]:
                req.num_inflight_tokens -= len(chunk.token_ids)
                if caching:
                    self.bm.cache_full_blocks(req)  # its settled full blocks get names
            prompt_lps = self._new_prompt_logprobs(req, chunk, result)
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
            reason = req.check_stop()
            if reason is not None:
                self._finish(req, reason, now)
            lp = result.logprobs.get(chunk.request_id)
            events.append(RequestEvent(req.request_id, [tok], reason,
                                       [lp] if lp is not None else None, prompt_lps))
        self._landed(out)
        return events

    @staticmethod
    def _new_prompt_logprobs(req: Request, chunk: ScheduledChunk,
                             result: ExecuteResult) -> list[TokenLogprob] | None:
        """Echo: the chunk's prompt logprobs not yet published (a recomputed chunk scores
        positions again; those went out the first time)."""
        lps = result.prompt_logprobs.get(chunk.request_id)
        if not lps:
            return None
        first = chunk.start_pos + 1  # the prompt token the chunk's first row scores
        skip = max(0, req.prompt_logprobs_sent + 1 - first)
        if first + skip != req.prompt_logprobs_sent + 1:
            return None  # not the next in order (cannot happen: chunks land in order)
        new = lps[skip:]
        req.prompt_logprobs_sent += len(new)
        return new or None

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

    def charge_transfer_stall(self, out: SchedulerOutput, seconds: float) -> None:
        """The worker idled `seconds` before `out`'s batch for its copies (engine_core)."""
        requests = self.requests
        for c in out.chunks:
            req = requests.get(c.request_id)
            if req is not None:
                req.charge_transfer_stall(seconds)

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

    def _queue_of(self, req: Request) -> RequestQueue | None:
        """The waiting or rotary queue a request sits in (None: running)."""
        if req.state is RequestState.ROTARY:
            return self.rotary
        if req.state is RequestState.WAITING:
            return self.waiting
        return None

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

    # -- recovery (DESIGN §6): a peer lost KV memory; this core owns every request's state ----
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


def _first_running(victims: list[Request], plan: _Plan) -> int:
    """Index of the first victim still running: those before it were preempted this
    iteration (victims go lowest first, so the walks need not step over them again)."""
    head, running = plan.victim_head, RequestState.RUNNING
    while head < len(victims) and victims[head].state is not running:
        head += 1
    plan.victim_head = head
    return head


_request_of = operator.itemgetter(2)  # of a queue Entry


def _merge(
    runs: list[list[Entry]], key: Callable[[Request, float], tuple[object, ...]], now: float
) -> Iterator[Request]:
    """The requests of sorted runs in `key` order, computing keys only for those consumed.

    heapq.merge's order (equal keys: the earlier run first), without its per-item wrappers:
    the admission walk may consume a few hundred candidates per iteration."""
    if len(runs) == 1:  # one group (one SLO class, or a static policy): already in order
        return map(_request_of, runs[0])
    return _merge_runs(runs, key, now)


def _merge_runs(
    runs: list[list[Entry]], key: Callable[[Request, float], tuple[object, ...]], now: float
) -> Iterator[Request]:
    # A heap of (head's key, run index): the run index breaks ties as in heapq.merge. The
    # top run's entries that still come before the next run's head are yielded without
    # heap operations, and long stretches are found by galloping (keys at +1, +2, +4, ...
    # then a binary search), so a run that leads for many candidates costs O(log) keys.
    # Keys are pure functions of a queued request and `now`, so which ones are computed
    # does not change the order.
    heap = [(key(run[0][2], now), i) for i, run in enumerate(runs) if run]
    heapq.heapify(heap)
    pos = [0] * len(runs)
    while len(heap) > 1:
        i = heap[0][1]
        nxt = heap[1] if len(heap) == 2 or heap[1] < heap[2] else heap[2]
        run, j = runs[i], pos[i]
        n = len(run)
        yield run[j][2]
        j += 1
        if j == n:
            heapq.heappop(heap)
            continue
        head = (key(run[j][2], now), i)
        if head < nxt:  # run i leads on: find where its lead ends
            lo, step = j, 1  # run[lo] comes before nxt
            hi = n  # the first entry that does not (or the end), and its key:
            stop: tuple[tuple[object, ...], int] | None = None
            while True:
                probe = j + step
                if probe >= n:
                    break
                k = (key(run[probe][2], now), i)
                if not k < nxt:
                    hi, stop = probe, k
                    break
                lo, step = probe, step * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                k = (key(run[mid][2], now), i)
                if k < nxt:
                    lo = mid
                else:
                    hi, stop = mid, k
            for e in run[j:hi]:
                yield e[2]
            j = hi
            if stop is None:  # run i is done
                heapq.heappop(heap)
                continue
            head = stop
        pos[i] = j
        heapq.heapreplace(heap, head)
    if heap:  # one run left: the rest of it in order, no keys needed
        i = heap[0][1]
        for e in runs[i][pos[i]:]:
            yield e[2]


@dataclass(slots=True)
class Recovery:
    """What kv_lost() did, by request id."""

    kept: list[str] = field(default_factory=list)  # KV intact: carry on running
    swap_in: list[str] = field(default_factory=list)  # rotary: host-copied prefix + recompute
    recompute: list[str] = field(default_factory=list)  # waiting: recompute every token

    def as_dict(self) -> dict[str, int]:
        return {"kept": len(self.kept), "swap_in": len(self.swap_in),
                "recompute": len(self.recompute)}
