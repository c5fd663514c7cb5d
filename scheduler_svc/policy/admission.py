"""Admission: bring waiting and rotary requests onto the device, most deserving first
(LVF steps 2–3; the baselines' orders through the same walk).

The walk goes down the policy's candidates and seats each one that fits the free blocks,
or that preempting victims makes fit (policy/victims.py), within the token budget, the
seats and B_xfer. A candidate that cannot be served is skipped (unless the policy stops
there); once nobody may be preempted, only the free blocks serve and the walk skips the
candidates too large for them without looking at each. Candidates come by priority class
(policy/priority.py): the walk ends at a less urgent class where it passed over one of a
more urgent class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from scheduler_svc.policy.base import Unservable, deadline_order
from scheduler_svc.policy.priority import classes_first, may_displace, merged
from scheduler_svc.policy.rotation import rotation_needed
from scheduler_svc.policy.state import Plan, SchedulingState, first_running
from scheduler_svc.policy.victims import pick_victims, room
from scheduler_svc.request import Request, RequestState


def admit(state: SchedulingState, order: Sequence[Request], plan: Plan,
          fcfs_mode: bool) -> None:
    """Seat candidates for this iteration; `order` is the running requests' order (its
    reverse, past their minimum residency, gives the victims)."""
    bm, policy, limits = state.blocks, state.policy, state.policy.limits
    if plan.budget <= 0 or not (state.waiting or state.rotary):
        return  # nothing to admit, or no token left to give: skip ordering everyone
    queue: Iterable[Request]
    if fcfs_mode:
        queue = classes_first(deadline_order(state.rotary.list() + state.waiting.list()))
    else:
        runs = policy.candidate_runs(state.waiting.groups() + state.rotary.groups(), plan.now)
        queue = merged(runs, policy.merge_key, plan.now, state.shares)
    rotate = not fcfs_mode
    hold: frozenset[str] = frozenset()  # parked ones that go first (rotation_needed)
    parked_within: float | None = None  # a parked one preempts only under this slack
    growth_per_seat = 0.0  # ... and until then leaves this many free blocks per seat
    if rotate and limits.lazy_rotation and policy.lazy_rotation:
        rotate, queue, hold, parked_within, growth_per_seat = rotation_needed(
            state.rotation_inputs(), iter(queue), plan.now, plan.budget)
    # Preemption victims, lowest first: past their minimum residency (FCFS-like
    # iterations, and lazy ones that need no rotation, preempt nobody for a candidate).
    it, running = state.iteration, RequestState.RUNNING
    residency = policy.min_residency(state.waiting, len(state.running), plan.now) if rotate else 0
    rotary_state = RequestState.ROTARY  # (an Enum member lookup is slow: a local)
    victims = [] if not rotate else [
        r for r in reversed(order)
        if r.state is running and it - r.admitted_iteration > residency
    ]
    cap = limits.xfer_budget_blocks
    bs = state.block_size
    plan.reserve = 0 if fcfs_mode else policy.growth_reserve_blocks(len(state.running), bs)
    # Whether the seat limit is the iteration-time budget's (below max_num_seqs): with
    # every seat taken, the seat a candidate needs is then one the budget holds back.
    budget_seats = state.seat_limit < state.max_num_seqs
    free_only = False
    fits_waiting: int | None = None  # while free_only: see free_fits
    fits_rotary: int | None = None
    # The tokens a parked candidate not yet due may need at most to fit the blocks it may
    # take (early_fits; None: not worked out since the last admission or preemption).
    fits_early: int | None = None
    tables = bm.tables
    # The priority class walked, and how many of the candidates looked at were seated: a
    # less urgent class gets nothing once one of a more urgent class was passed over.
    walked: int | None = None
    looked = seated = 0
    for q in queue:
        if q.fork_of is not None:
            continue  # one of n choices, waiting for its leader's prompt blocks
        if q.priority != walked:
            if looked > seated:
                break
            walked = q.priority
        looked += 1
        if free_only:
            # Fast skip: it needs blocks_for(min(num_tokens, computed + budget)) > room
            # blocks, i.e. both of those over room * block_size tokens (num_tokens inlined).
            fits = fits_rotary if q.state is rotary_state else fits_waiting
            if fits is None or (
                    len(q.prompt_token_ids) + len(q.output_token_ids) + q.num_placeholders
                    > fits and q.num_computed_tokens + plan.budget > fits):
                continue
        if plan.budget <= 0:
            break
        # With every seat taken, a candidate must displace someone (LVF may; FCFS-like
        # policies wait for a seat to free up).
        need_seat = len(state.running) >= state.seat_limit
        policy.time_bound = need_seat and budget_seats  # for may_preempt
        if need_seat and (fcfs_mode or not victims):
            break
        if q.request_id in plan.displaced:
            continue  # taken off the device this iteration: its D2H copy is in flight
        rotary = q.state is RequestState.ROTARY
        if rotary and not policy.may_swap_in(q, plan.preempted):
            continue
        early = (rotary and parked_within is not None
                 and not parked_must_preempt(state, q, plan.now, parked_within))
        if early and not free_only:
            # Fast skip, the same outcome as the walk below: a parked candidate not yet
            # due takes only a free seat and blocks it fits in.
            if fits_early is None:
                fits_early = early_fits(state, plan, growth_per_seat)
            if fits_early >= 0 and (need_seat or (
                    len(q.prompt_token_ids) + len(q.output_token_ids) + q.num_placeholders
                    > fits_early and q.num_computed_tokens + plan.budget > fits_early)):
                if cap is not None and plan.xfer_used and (
                        plan.xfer_used + len(tables[q.request_id].device) > cap):
                    break
                continue
        # Tokens to compute, blocks taken, blocks copied in (a cached prefix counts).
        n, need, cost = bm.admission(q, plan.budget)
        swaps_in = rotary or cost > 0  # an H2D copy fills some of its blocks
        # A request larger than B_xfer may still move alone, or it would starve.
        if cap is not None and plan.xfer_used and plan.xfer_used + cost > cap:
            break
        chosen: list[Request] | None
        if free_only or early:
            # Nobody may be preempted (any more, or for this parked candidate yet): only
            # free blocks serve; a parked one not yet due leaves the running requests
            # room to grow until the next finish (rotation_needed).
            if need_seat and free_only:
                break
            reserve = plan.reserve
            if early:
                reserve += math.ceil((len(state.running) + 1) * growth_per_seat)
            if need_seat or need > room(state, swaps_in, reserve):
                continue
            chosen = []
        elif fcfs_mode:
            chosen = []
        else:
            # As many victims as q's seat takes: the seat limit can drop below the running
            # count, and one victim then seated nobody, batch after batch.
            seats = len(state.running) - state.seat_limit + 1
            chosen = pick_victims(state, q, need, swaps_in, cost, victims, plan, seats)
        if chosen is None:
            if q.request_id in hold:
                break  # its blocks free up for it first, not for a new request past it
            if policy.on_unservable(q, plan.now) is Unservable.STOP:
                break  # strict order: stop at the first request that cannot be served
            # Serve who can be served; q's lag keeps growing meanwhile.
            if may_preempt_for(state, q, victims, plan):
                continue
            # Nobody may be preempted for q, nor (lagging less) for anyone after it.
            if free_below_least(state, plan):
                break
            free_only = True
            fits_waiting, fits_rotary = free_fits(state, plan)
            continue
        if rotary:
            state.count_parked_preemptions(len(chosen))
        for v in chosen:
            state.preempt(v, plan)
        fits_early = None  # blocks and seats change below (or the walk ends)
        n, need, cost = bm.admission(q, plan.budget)
        if (need > room(state, rotary or cost > 0, plan.reserve) or n <= 0
                or len(state.running) >= state.seat_limit):
            break
        plan.xfer_used += cost
        seated += 1
        if not state.admit(q, n, plan):
            continue  # its swap-in waits for the batch in flight: it computes next batch
        plan.tokens[q.request_id] = n
        state.shares.seat(q, n)
        plan.budget -= n
        if free_only:
            if free_below_least(state, plan):
                break
            fits_waiting, fits_rotary = free_fits(state, plan)


def early_fits(state: SchedulingState, plan: Plan, growth_per_seat: float) -> int:
    """The tokens a parked candidate not yet due may need at most to fit the blocks it may
    take (those that leave the running requests room to grow); -1 where that test is not
    exact (a device block cache: a swap-in may reuse cached blocks)."""
    if state.blocks.caches_device_blocks:
        return -1
    reserve = plan.reserve + math.ceil((len(state.running) + 1) * growth_per_seat)
    return max(0, room(state, True, reserve)) * state.block_size


def parked_must_preempt(state: SchedulingState, q: Request, now: float,
                        within_s: float) -> bool:
    """May parked `q` preempt where seats are not waited for? Only with less slack than
    `within_s`, or none it counts on (slack_s None: late, which preempts nobody anyway,
    or past the catch-up it counts on but not late)."""
    slack = state.policy.slack_s(q, now)
    return slack is None or slack < within_s


def may_preempt_for(state: SchedulingState, q: Request, victims: Sequence[Request],
                    plan: Plan) -> bool:
    """May the first eligible victim be preempted for `q`? When not, no later victim may
    be (they come lowest first), nor for any later candidate (lagging less)."""
    head = first_running(victims, plan)
    return head < len(victims) and may_displace(state.policy, victims[head], q, plan.now,
                                                     state.shares)


def free_below_least(state: SchedulingState, plan: Plan) -> bool:
    """Are the free blocks fewer than the smallest candidate needs? Then walking the rest
    of thousands of candidates would serve nobody."""
    free = state.blocks.num_free_for_compute - plan.reserve
    if free <= 0:
        return True
    sizes = [n for n in (state.waiting.min_tokens(), state.rotary.min_tokens()) if n]
    # The least any candidate can need: its whole context, or a budget-sized chunk.
    return free < state.blocks.blocks_for(min([*sizes, plan.budget]))


def free_fits(state: SchedulingState, plan: Plan) -> tuple[int | None, int | None]:
    """While nobody may be preempted: the tokens a waiting and a rotary candidate may need
    at most to fit the free blocks (room · block_size); None where no request of that
    queue fits, so that the walk passes them over without a look at each."""
    bs, budget = state.block_size, plan.budget
    out: list[int | None] = []
    for queue, swap_in in ((state.waiting, False), (state.rotary, True)):
        free = room(state, swap_in, plan.reserve)
        fits, least = free * bs, queue.min_tokens()
        # A rotary request holds KV: it needs a block at least. Any request needs more
        # than `fits` where its num_tokens and computed + budget both exceed it.
        none_fits = (swap_in and free <= 0) or (
            least is not None and least > fits and budget > fits)
        out.append(None if none_fits else fits)
    return out[0], out[1]
