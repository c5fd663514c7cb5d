"""Running requests get their tokens first; one that finds no block for them preempts
from the tail of the policy's order (LVF step 4, reactive preemption)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.policy.state import Plan, SchedulingState
from scheduler_svc.request import Request, RequestState


def schedule_running(state: SchedulingState, order: Sequence[Request], plan: Plan) -> None:
    """Each running request in `order` gets its next chunk (a decode: one token) within the
    token budget; where blocks run out, the last running request in the order is
    preempted (the request itself where none is after it)."""
    blocks = state.blocks
    try_grow, running, tokens = blocks.try_grow, RequestState.RUNNING, plan.tokens
    tables, bs = blocks.tables, state.block_size
    # Per running request per iteration: kept lean (it dominates the decision's cost):
    # num_tokens inlined, the budget in a local (preemption changes plan.budget), and
    # try_grow's fast path (the tokens fit the blocks it holds: most decode steps).
    budget = plan.budget
    last = len(order) - 1
    spec = state.speculator
    for i, req in enumerate(order):
        if req.state is not running:
            continue  # preempted earlier in this loop
        placeholders = req.num_placeholders
        if placeholders and (req.finishes_when_outputs_land
                             or (spec is not None and spec.sits_out(req))):
            # Its last token is being sampled: nothing left to compute, or it is copying
            # from its context and proposes drafts once that token is known.
            continue
        computed = req.num_computed_tokens
        n = len(req.prompt_token_ids) + len(req.output_token_ids) + placeholders - computed
        if n > 1 and n > budget - (last - i):
            # A chunk leaves a token for each running request after it: a decode left out
            # of the batch misses its gap for a prompt chunk that only moves a TTFT.
            n = budget - (last - i)
        if n > budget:
            n = budget
        if n <= 0:
            if budget <= 0:
                break
            continue
        rid = req.request_id
        t = tables.get(rid)
        if n == 1 and spec is not None and not placeholders:
            # A decode whose last token is known: drafts, where they fit (the budget left
            # after a token for each request after it, and free blocks without preempting).
            drafts = spec.drafts(req, budget - 1 - (last - i))
            if drafts and try_grow(req, 1 + len(drafts)):
                n += len(drafts)
                plan.drafts[rid] = drafts
                t = tables.get(rid)
        if (t is None or computed + n > len(t.device) * bs) and not try_grow(req, n):
            plan.budget = budget
            while not try_grow(req, n):
                victim = next((v for v in reversed(order[i + 1 :]) if v.state is running),
                              None)
                state.count_growth_preemption()
                if victim is None:
                    state.preempt(req, plan)
                    break
                state.preempt(victim, plan)
            budget = plan.budget
            if req.state is not running:
                continue
        tokens[rid] = n
        budget -= n
    plan.budget = budget
