"""Largest-VLT-First (DESIGN §4): rotate requests by how far they lag their SLOs.

Candidates (waiting and rotary requests) come in two tiers. A request that can still meet
the SLO it waits on is *on time*; on-time requests go first, largest VLT first. A request
that can no longer make it — admitted now, its first token would come after its TTFT
deadline (two batches: vlt.deadline), or parked past its deadline (its pace, plus what it
can still win back) — is *late*: it is served from what the on-time ones leave, oldest
deadline first, and never preempts anyone.
Measured in the simulator (docs/results/rotasched/): without the tiers, a parked request's lag
grows without bound and, under sustained overload, rotary requests that can no longer be
saved take every seat from new requests that still could be (TTFT attainment 69 % where
the tiers give 100 %, gh200, 20 req/s). What a parked request can win back depends on the
time between tokens it would get, which the policy follows from the executed batches
(`observe_iteration`): on the CPU stack, where an iteration is a fifteenth of the TBT
SLO, a request parked past its pace catches up within its remaining tokens, and counting
it as late starved it while arrivals continued (docs/results/rotasched/, 1.5×).

Groups for the lazy order (see policy/base.py): VLT depends on time only through
`now - anchor`, where the anchor is the arrival (no token yet) or, for a started request
not running, the earlier of its deadline and its stall bound (its last token plus
`max_stall` of its TTFT SLO), scaled by the request's own SLO. Requests with the same
formula and the same SLO therefore keep their relative order while the time between
tokens the deadlines use stays put: one group per (formula, SLO), sorted by anchor; each group's late
prefix is split off as a run of its own (`candidate_runs`). That time follows the batches'
mean in 10 % steps, and each step re-files the queues. Running requests' deadlines move
with their tokens: the scheduler sorts them each iteration (`static_running_order`).

A victim's slack is its deadline less now, but parked it waits for its VLT to overtake the
new requests', which under overload takes longer than that slack: rotated out with
seconds to spare, it came back late (on the CPU stack at 1.5x, 64-token requests parked
with 14 s of slack stalled 23-34 s; docs/results/rotasched/). With
`limits.park_cover` = c a started request is a victim only where its slack covers c
times the mean stay parked of its SLO class (`observe_park`, from the resumes): the
requests that could not sit out a typical stay keep their seats. It trades TTFT for TPOT
(docs/results/rotasched/, "A victim's slack against the time parked").

Where the seat a candidate needs is held by memory or max_num_seqs rather than by the
iteration-time budget (`time_bound` False: the batch is short of the TBT target and the
running streams meet TPOT with room), it must lag its victim by `limits.memory_margin`
more: there each rotation parks a stream that would have met its TPOT to seat a request
that may still make its TTFT by waiting. Where the budget holds the seats every stream's
gap is near the target and slack alone decides (docs/results/rotasched/, "A margin
where the batch time does not hold the seat").
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from scheduler_svc.policy.base import OrderKey, Policy, RotationLimits, Unservable
from scheduler_svc.policy.residency import AdaptiveResidency
from scheduler_svc.policy.vlt import (
    FIRST_TOKEN_BATCHES,
    OutputLengths,
    VLTParams,
    catch_up_limit,
    deadline,
    is_late,
    lag_anchor,
    tokens_left,
    vlt,
)
from scheduler_svc.queue import Entry
from scheduler_svc.request import SLO, FinishReason, Request, RequestState

if TYPE_CHECKING:
    from scheduler_svc.policy.state import Queue


class LVFPolicy(Policy):
    name = "lvf"
    bounded_transfers = True
    # An iteration is a decode request's time between tokens: keep it under 90 % of the
    # tightest TBT SLO (the pipelined step's gap is the iteration plus a little; at 100 %
    # a quarter of the gaps came out just over the SLO, docs/results/simulator/ §10).
    default_iteration_budget = 0.9

    # A running request's VLT follows its tokens (its deadline moves with each), so the
    # scheduler sorts the running requests each iteration (at most the batch's seats).
    static_running_order = False
    lazy_rotation = True  # rotate only where waiting for finishing requests would not do
    GAP_STEP = 0.1  # the deadlines' time between tokens follows its mean in 10 % steps
    # The deadlines' snapshot of finished requests' output lengths (vlt.tokens_left) is
    # renewed once an eighth of the lengths kept are new, and at least this many.
    LENGTHS_STEP = 16

    def __init__(self, params: VLTParams, limits: RotationLimits) -> None:
        self.params = params
        self.limits = limits
        # may_preempt is asked for one candidate against victim after victim: its side of
        # the comparison, for the last (candidate, time) asked.
        self._asked: tuple[Request | None, float, float | None] = (None, 0.0, None)
        # The running requests' VLTs as `running_order` ranked them at a time (request_id
        # -> VLT). The scheduler ranks them at the start of each schedule() and asks
        # may_preempt about them within it, before any of their tokens change; asked at
        # another time, may_preempt works the VLT out afresh.
        self._ranked: tuple[float, dict[str, float]] = (0.0, {})
        # The time between tokens a request gets when served: a moving mean of the
        # executed batches' times (None until the first batch), and the value the
        # deadlines use, which follows it only when it moves by more than GAP_STEP (a
        # parked request's deadline depends on it: each move re-sorts the rotary queue).
        self._gap_mean: float | None = None
        self.gap_s: float | None = None
        # How long a parked request stays parked before it comes back, per SLO class
        # (S_B, S_F): a moving mean over its resumes, for limits.park_cover.
        self._park_s: dict[tuple[float, float], float] = {}
        # Finished requests' output lengths, for the deadlines of requests whose length
        # is not known (vlt.tokens_left), and the sorted snapshot the deadlines use: a new
        # one with each re-filing of the queues, as for gap_s.
        self.output_lengths = OutputLengths()
        self.lengths: tuple[int, ...] = ()
        self._lengths_at = 0
        # The minimum residency, adapted to the late waiting requests (policy/residency.py).
        self.residency = (AdaptiveResidency(limits.min_residency) if limits.adapt_residency
                          else None)

    def set_lag_unit(self, unit_s: float | None) -> None:
        if unit_s != self.lag_unit_s:
            self.lag_unit_s = unit_s
            self._asked = (None, 0.0, None)
            self._ranked = (0.0, {})

    def observe_iteration(self, seconds: float) -> bool:
        m = self._gap_mean
        self._gap_mean = m = seconds if m is None else 0.9 * m + 0.1 * seconds
        g = self.gap_s
        step = g is None or abs(m - g) > self.GAP_STEP * g
        out = self.output_lengths
        new = out.added - self._lengths_at
        if not step and new < max(self.LENGTHS_STEP, len(self.lengths) // 8):
            return False
        if step:
            self.gap_s = m
        if new:
            self.lengths, self._lengths_at = out.view(), out.added
        self._asked = (None, 0.0, None)
        self._ranked = (0.0, {})
        return True

    def min_residency(self, waiting: Queue, running: int, now: float) -> int:
        r = self.residency
        if r is None:
            return self.limits.min_residency
        # Waiting requests in a group are in their deadlines' order: count each group's
        # late ones from its head, no further than the count that leaves no residency.
        limit, late, gap = r.count_limit(running), 0, self.gap_s
        for run in waiting.live_groups():
            for _, _, req in run:
                if late >= limit or not is_late(req, now, gap):
                    break
                late += 1
        return r.update(late, running)

    def observe_finish(self, req: Request) -> None:
        if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.output_lengths.observe(len(req.output_token_ids))

    def observe_park(self, req: Request, now: float) -> None:
        d, key = now - req.state_since, (req.slo.ttft_s, req.slo.tbt_s)
        m = self._park_s.get(key)
        self._park_s[key] = d if m is None else 0.9 * m + 0.1 * d

    def park_s(self, slo: SLO) -> float | None:
        """The mean stay parked of requests of this SLO class (None: none came back yet)."""
        return self._park_s.get((slo.ttft_s, slo.tbt_s))

    def is_late(self, req: Request, now: float) -> bool:
        return is_late(req, now, self.gap_s)

    def slack_s(self, candidate: Request, now: float) -> float | None:
        # By what it counts on (vlt.tokens_left). A request of unknown length may have
        # used up the catch-up it counts on and not be late (its max_tokens might still
        # bring it back): it then triggers no rotation, nor do those after it
        # (policy/rotation.py), and takes free seats first. Measured (docs/results/rotasched/): counting it as
        # on time with no slack left doubled LVF's rotations on gh200-96gb at 17 req/s
        # (6,961 against 3,220) and cost 10 points of TPOT.
        # vlt.deadline's arithmetic inlined (admission asks it of every parked candidate
        # it walks past, tens per iteration); tests/test_policy.py checks it against it.
        slo, first, gap = candidate.slo, candidate.first_token_time, self.gap_s
        if first is None:
            dl = candidate.arrival_time + slo.ttft_s
            if gap is not None:
                dl = dl - FIRST_TOKEN_BATCHES * gap
        else:
            tbt = slo.tbt_s
            k = len(candidate.output_token_ids) + candidate.num_placeholders  # tokens_out
            dl = first + k * tbt
            if gap is not None and tbt > gap:  # catch_up_limit, within tokens_left
                win = tbt - gap
                left = (candidate.sampling.max_tokens - k if candidate.length_known
                        else tokens_left(candidate, k, self.lengths))
                extra = left * win - tbt
                if win < gap:  # only the exchange rate's share counts
                    extra = extra * win / gap
                if extra > 0.0:
                    dl = dl + extra
        slack = dl - now
        return slack if slack >= 0.0 else None

    def prompt_batches_s(self, candidate: Request, chunk_tokens: int) -> float:
        # A new request's deadline leaves two batches for its first token (vlt.deadline):
        # a prompt longer than one batch's prompt tokens takes a batch per further chunk.
        gap = self.gap_s
        if gap is None or chunk_tokens <= 0 or candidate.first_token_time is not None:
            return 0.0
        left = len(candidate.prompt_token_ids) - candidate.num_computed_tokens
        return (-(-left // chunk_tokens) - 1) * gap if left > chunk_tokens else 0.0

    def order_key(self, req: Request, rotary: bool) -> OrderKey:
        # Highest VLT first = earliest anchor first within a group; ties to the earlier arrival.
        if req.first_token_time is None:
            return ("ttft", req.slo.ttft_s), (req.arrival_time,)
        # Its lag is scaled by S_B: one group per (S_F, S_B), not per S_F alone; and one
        # for those of unknown length, whose late ones are not a prefix (candidate_runs).
        return ("tbt", req.slo.tbt_s, req.slo.ttft_s, req.length_known), (
            lag_anchor(req, self.params, self.gap_s, self.lengths), req.arrival_time)

    def merge_key(self, req: Request, now: float) -> tuple[float, ...]:
        # is_late, lag_anchor and vlt of a candidate in one pass, the same arithmetic in
        # the same order (the admission walk asks it of hundreds of candidates per
        # iteration); tests/test_policy.py checks it against the definitions.
        p, slo, first = self.params, req.slo, req.first_token_time
        if first is None:
            if req.state is RequestState.RUNNING:  # not a candidate: the definitions' way
                if is_late(req, now, self.gap_s):
                    return (1.0, lag_anchor(req, p), req.arrival_time)
                return (0.0, -vlt(req, now, p), req.arrival_time)
            arrival = req.arrival_time
            dl = arrival + slo.ttft_s  # vlt.deadline
            if self.gap_s is not None:
                dl = dl - FIRST_TOKEN_BATCHES * self.gap_s
            if now > dl:  # late
                return (1.0, arrival + (1.0 - p.beta_b) * slo.ttft_s, arrival)
            v = (now - arrival) / slo.ttft_s - (1.0 - p.beta_b)
            if self.lag_unit_s is not None:
                v = v * (slo.ttft_s / self.lag_unit_s)
            return (0.0, -v, arrival)
        k = len(req.output_token_ids) + req.num_placeholders  # vlt.tokens_out
        tbt, gap = slo.tbt_s, self.gap_s
        dl = late_at = first + k * tbt  # vlt.deadline, for its order and for is_late
        if gap is not None:
            extra = catch_up_limit(req.sampling.max_tokens - k, tbt, gap)
            if extra > 0.0:
                late_at = dl + extra
            if req.length_known:
                dl = late_at
            else:  # its order counts on fewer tokens (vlt.tokens_left)
                extra = catch_up_limit(tokens_left(req, k, self.lengths), tbt, gap)
                if extra > 0.0:
                    dl = dl + extra
        anchor = dl - p.beta_f * k * tbt
        cap = p.max_stall
        if cap is not None:  # vlt.stall_anchor: only a request not running
            last = req.last_token_time
            if last is not None and req.state is not RequestState.RUNNING:
                anchor = min(anchor, last + cap * slo.ttft_s)
        if now > late_at:
            return (1.0, anchor, req.arrival_time)
        lag = (now - anchor) / slo.ttft_s
        v = p.alpha * lag if lag >= 0.0 else lag / p.alpha
        if self.lag_unit_s is not None:
            v = v * (slo.ttft_s / self.lag_unit_s)
        return (0.0, -v, req.arrival_time)

    def candidate_runs(self, runs: list[list[Entry]], now: float) -> list[list[Entry]]:
        # Each group is sorted by lag anchor; its late requests become a run of their own.
        # Where the anchor is the deadline (new requests; started ones with beta_f = 0, no
        # stall bound and a known length) the late ones are a prefix, else any of the run.
        out = []
        late_now = self.is_late
        p = self.params
        deadline_anchors = p.beta_f == 0.0 and p.max_stall is None
        for run in runs:
            if not run:
                continue
            head = run[0][2]
            if head.first_token_time is None or (deadline_anchors and head.length_known):
                cut = bisect.bisect_left(run, True, key=lambda e: not late_now(e[2], now))
                late, on_time = run[:cut], (run[cut:] if cut else run)
            else:
                late = [e for e in run if late_now(e[2], now)]
                on_time = [e for e in run if not late_now(e[2], now)] if late else run
            if late:
                out.append(late)
            if on_time:
                out.append(on_time)
        return out

    def running_key(self, req: Request) -> OrderKey:
        return 0, ()  # no static order (static_running_order): sorted each iteration

    def running_merge_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (-vlt(req, now, self.params, self.gap_s, self.lag_unit_s, self.lengths),
                req.arrival_time)

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        # sorted(running, key=running_merge_key), each VLT computed once with vlt()'s
        # arithmetic inlined (this runs over the whole batch every iteration: the calls
        # through deadline, due_time and tokens_out were most of the decision's cost), and
        # kept for may_preempt, whose victims are these requests at this same `now`.
        # tests/test_policy.py checks both against the definitions.
        p, gap, unit, lengths = self.params, self.gap_s, self.lag_unit_s, self.lengths
        alpha, beta_f, beta_b, cap = p.alpha, p.beta_f, p.beta_b, p.max_stall
        running_state = RequestState.RUNNING  # (an Enum member lookup is slow: a local)
        vlts: dict[str, float] = {}
        keyed = []
        for i, r in enumerate(running):
            first, slo = r.first_token_time, r.slo
            if first is not None:
                k = len(r.output_token_ids) + r.num_placeholders  # tokens_out
                tbt = slo.tbt_s
                dl = first + k * tbt  # deadline: due_time, plus catch_up_limit
                if gap is not None:
                    win = tbt - gap
                    if win > 0.0:
                        left = (r.sampling.max_tokens - k if r.length_known
                                else tokens_left(r, k, lengths))
                        extra = left * win - tbt
                        if win < gap:  # only the exchange rate's share counts
                            extra = extra * win / gap
                        if extra > 0.0:
                            dl = dl + extra
                if beta_f:  # lag_anchor (with β_F = 0, the default, it is the deadline)
                    dl = dl - beta_f * k * tbt
                if cap is not None:  # stall_anchor: only a request not running
                    last = r.last_token_time
                    if last is not None and r.state is not running_state:
                        dl = min(dl, last + cap * slo.ttft_s)
                lag = (now - dl) / slo.ttft_s
                v = alpha * lag if lag >= 0.0 else lag / alpha
                if unit is not None:
                    v = v * (slo.ttft_s / unit)
            elif r.state is RequestState.RUNNING:  # prefilling
                start = r.run_start_time if r.run_start_time is not None else now
                v = -(now - start) / (alpha * slo.tbt_s)
            else:
                v = (now - r.arrival_time) / slo.ttft_s - (1.0 - beta_b)
                if unit is not None:
                    v = v * (slo.ttft_s / unit)
            vlts[r.request_id] = v
            keyed.append((-v, r.arrival_time, i))  # i: ties keep sorted()'s stable order
        keyed.sort()
        self._ranked = (now, vlts)
        return [running[e[2]] for e in keyed]

    def growth_reserve_blocks(self, num_running: int, block_size: int) -> int:
        # A free-block watermark, as the paper's code keeps: a block for every running
        # request, so that admission and swap-ins do not take the blocks the running ones
        # grow into (each needs at most one more per block_size tokens).
        return num_running

    def plain_fcfs(self, everything_fits: bool) -> bool:
        # LVF step 1: while memory is not short, rotating anyone only costs transfers.
        return everything_fits

    def prefill_demand(self, waiting: Iterable[list[Entry]], now: float) -> float:
        # Prompt tokens per second that on-time new requests need to be prefilled within
        # `prefill_within` of their TTFT SLO. Late ones are not counted: they are served
        # from what is left. Walks each run from its newest request to the first late one,
        # so the cost is bounded by the arrivals of one TTFT budget, not the backlog.
        within = self.limits.prefill_within
        # vlt.deadline: a first token comes up to FIRST_TOKEN_BATCHES after admission
        batch = FIRST_TOKEN_BATCHES * (self.gap_s or 0.0)
        demand = 0.0
        for run in waiting:
            for e in reversed(run):
                q = e[2]
                if (q.first_token_time is not None
                        or now > q.arrival_time + q.slo.ttft_s - batch):
                    break
                demand += (q.num_tokens - q.num_computed_tokens) / (within * q.slo.ttft_s)
        return demand

    def on_unservable(self, candidate: Request, now: float) -> Unservable:
        # Skip by default: the simulator measured the strict rule blocking new requests
        # behind a large rotary one (docs/results/simulator/). But a new request lagging past
        # hold_vlt holds the line: without this a large prompt waits while later, smaller
        # ones keep taking the free blocks (measured on the real stack: 21 s TTFT with 13
        # blocks free, docs/results/rotasched/).
        return Unservable.STOP if self.holds_the_line(candidate, now) else Unservable.SKIP

    def holds_the_line(self, candidate: Request, now: float) -> bool:
        """Must admission stop at this new request so that free blocks gather for it? Its
        VLT in its own TTFT SLO (hold_vlt is a share of its own budget), whatever the unit
        of the order."""
        hold = self.limits.hold_vlt
        return (hold is not None and candidate.first_token_time is None
                and candidate.state is RequestState.WAITING
                and vlt(candidate, now, self.params, self.gap_s) >= hold)

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        asked, at, bar = self._asked
        if asked is not candidate or at != now:
            # A late request is served from free capacity only: it preempts nobody.
            bar = (None if is_late(candidate, now, self.gap_s)
                   else vlt(candidate, now, self.params, self.gap_s, self.lag_unit_s,
                            self.lengths)
                   - self.limits.vlt_margin)
            self._asked = (candidate, now, bar)
        if bar is None:
            return False
        at, ranked = self._ranked
        v = ranked.get(victim.request_id) if at == now else None
        if v is None:
            v = vlt(victim, now, self.params, self.gap_s, self.lag_unit_s, self.lengths)
        if not (v < 0.0 and v < (bar if self.time_bound else bar - self.limits.memory_margin)):
            return False
        cover = self.limits.park_cover
        if cover is None or victim.first_token_time is None:
            return True
        # A started victim must have the slack to sit out a typical stay parked (module doc).
        park = self.park_s(victim.slo)
        return park is None or deadline(victim, self.gap_s, self.lengths) - now >= cover * park
