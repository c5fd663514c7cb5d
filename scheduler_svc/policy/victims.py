"""Victim choice: which running requests to take off the device for a candidate.

Victims come lowest first (the policy's order, the least urgent priority class first:
policy/priority.py, which also says who may displace whom across classes); nobody is
preempted unless the candidate then fits, since a rotation that serves nobody only costs
transfers, and the blocks moved in an iteration stay within B_xfer
(`limits.xfer_budget_blocks`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from scheduler_svc.policy.priority import may_displace
from scheduler_svc.policy.state import Plan, SchedulingState, first_running
from scheduler_svc.request import Request, RequestState


def room(state: SchedulingState, for_swap_in: bool, reserve: int = 0) -> int:
    """Free device blocks for a candidate. A swap-in's H2D copy may not target blocks that
    a D2H copy of this very iteration still reads; compute may (it writes after the
    transfers complete)."""
    b = state.blocks
    return (b.num_free_for_swap_in if for_swap_in else b.num_free_for_compute) - reserve


def pick_victims(state: SchedulingState, q: Request, need: int, rotary: bool, cost: int,
                 victims: Sequence[Request], plan: Plan, seats: int = 0
                 ) -> list[Request] | None:
    """Victims whose preemption makes room for `q` (`need` blocks, `cost` of them copied
    in) within B_xfer, and at least `seats` of them (≤ 0 where a seat is free); None if
    impossible."""
    policy = state.policy
    cap = policy.limits.xfer_budget_blocks
    free, moved = room(state, rotary, plan.reserve), plan.xfer_used + cost
    head = first_running(victims, plan)
    busy_counts = rotary or not state.blocks.same_iteration_reuse
    chosen: list[Request] = []
    for v in itertools.islice(victims, head, None):
        if need <= free and len(chosen) >= seats:
            break
        if v.state is not RequestState.RUNNING:
            continue
        if not may_displace(policy, v, q, plan.now, state.shares):
            break  # victims come lowest first: later ones may not be preempted either
        if not chosen:  # someone may be preempted: would even all of them make room?
            if not plan.victim_bound:
                count_releasable(state, victims[head:], plan)
            if need > free + plan.releasable[busy_counts]:
                return None
        out_cost, held, busy = victim_blocks(state, v, plan)
        if cap is not None and moved and moved + out_cost > cap:
            continue
        # Blocks a rotate-out copies stay busy until the copy ran: never usable by a
        # swap-in this iteration, and by compute only in a serial step. Blocks another
        # request shares are not released at all.
        free += held - busy if busy_counts else held
        moved += out_cost
        chosen.append(v)
    return chosen if need <= free and len(chosen) >= seats else None


def count_releasable(state: SchedulingState, victims: Sequence[Request], plan: Plan) -> None:
    """plan.releasable for the running ones of `victims`: each adds at most every device
    block of its own (of those, a swap-in may not use the ones a rotate-out copies)."""
    bound, tables = plan.victim_bound, state.blocks.tables
    running = RequestState.RUNNING
    total = 0
    for v in victims:  # up to the whole batch, once an iteration: kept lean
        if v.state is running:
            t = tables.get(v.request_id)  # num_device_blocks_of, inlined
            n = 0 if t is None else len(t.device) - t.device.count(None)
            bound[v.request_id] = (n, n)
            total += n
    plan.releasable[0] += total
    plan.releasable[1] += total


def victim_blocks(state: SchedulingState, v: Request, plan: Plan) -> tuple[int, int, int]:
    """A running request as a victim: (blocks a rotate-out copies, device blocks
    preempting it releases, how many of those the copy keeps busy)."""
    blocks = plan.victim_blocks.get(v.request_id)
    bm, policy = state.blocks, state.policy
    if blocks is None:
        swaps = policy.swaps_out(v)
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
        held, busy = bm.released_by_preempting(v, policy.swaps_out(v))
    return out_cost, held, busy
