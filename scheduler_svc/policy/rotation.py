"""Lazy rotation: does an on-time candidate need a running request's seat this iteration?

A rotation costs its victim a stalled gap; rotating for a candidate whose slack covers
the wait for a seat that finishing requests free anyway only costs gaps. The k-th
candidate in the policy's order gets one of those seats in about k / rate seconds, so
rotation is needed only where some candidate's slack (less `lazy_margin` of its TTFT SLO,
less the batches its prompt takes) does not cover that wait. The measurements behind each
rule are in docs/results/rotasched/ ("Why each default rule").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from scheduler_svc.policy.state import Rotation, RotationInputs
from scheduler_svc.request import Request, RequestState

LAZY_SCAN = 256  # candidates looked at, at most
# Lazy only where at least this many requests finish within a candidate's TTFT SLO: the
# rate is then known to ~25 % (which lazy_margin covers) and seats free often enough to
# wait for; with fewer, every candidate may rotate, a parked one only near its deadline.
LAZY_MIN_FINISHES = 16
# A parked request coming back early keeps room for the running requests' growth until
# the next finish only where at least this many finish within its TTFT SLO (fewer: a
# run's first seconds, a rate too low for the steady state).
GROWTH_MIN_FINISHES = 4


def rotation_needed(s: RotationInputs, queue: Iterator[Request], now: float,
                    chunk_tokens: int = 0) -> Rotation:
    """The answer and the queue to admit from (the candidates looked at put back first).

    * Seats beyond the limit: where more requests run than the limit allows, the first of
      them to finish free no seat; the k-th candidate waits for k plus that excess.
    * Only new requests' deadlines make rotation needed: a parked request comes back as
      its VLT rises or into free blocks (rotating for it parked one more running request,
      whose deadline then asked for the next).
    * With `parked_first`, as many parked candidates as the new ones can spare seats for
      (the k-th, with slack s, can wait (s − margin)·rate − k seats more) go ahead of
      every new one of its priority class: a parked request that streamed is stalled, a
      new one has time.
    * Too few finishes to wait for (LAZY_MIN_FINISHES): every candidate may rotate, a
      parked one only once its slack is under `lazy_margin` of its TTFT SLO; until then it
      comes back into free blocks only where they also hold `growth_room` of the running
      requests' growth until the next finish (`growth_blocks_per_seat`).
    """
    policy = s.policy
    seen: list[Request] = []
    needed = False
    rotary = RequestState.ROTARY
    rate = None
    margin = policy.limits.lazy_margin
    spare = float("inf")  # seats every new candidate looked at can still wait for
    parked: list[Request] = []  # on-time parked candidates looked at (parked_first)
    parked_first = policy.limits.parked_first
    k = 0
    over = max(0, s.running - s.seat_limit)  # finishes that free no seat
    for q in queue:
        seen.append(q)
        if q.fork_of is not None:
            continue
        slack = policy.slack_s(q, now)
        if slack is None:  # late: it preempts nobody, nor do those after it
            break
        if rate is None:
            rate = s.finish_rate(now, q.slo.ttft_s)
            finishes = rate * q.slo.ttft_s  # within the candidate's TTFT SLO
            if finishes < LAZY_MIN_FINISHES:
                gap, bs = policy.gap_s, s.block_size
                growth = (policy.limits.growth_room / (rate * gap * bs)
                          if finishes >= GROWTH_MIN_FINISHES and gap else 0.0)
                return Rotation(True, itertools.chain(seen, queue), frozenset(),
                                margin * q.slo.ttft_s, growth)
        k += 1
        if q.state is rotary:  # takes a seat before those behind it, triggers no rotation
            # ... but never ahead of a more urgent priority class (policy/priority.py)
            if parked_first and q.priority == seen[0].priority:
                parked.append(q)
        else:
            if len(q.prompt_token_ids) > chunk_tokens > 0:  # (most prompts: one batch)
                slack -= policy.prompt_batches_s(q, chunk_tokens)
            spare_here = (slack - margin * q.slo.ttft_s) * rate - k - over
            if spare_here < 0.0:
                needed = True
                break
            if spare_here < spare:
                spare = spare_here
        if k >= LAZY_SCAN:
            break
    if needed or not parked or spare < 1.0:
        return Rotation(needed, itertools.chain(seen, queue), frozenset(), None)
    first = parked if spare >= len(parked) else parked[:int(spare)]
    ahead = frozenset(q.request_id for q in first)
    rest = [q for q in seen if q.request_id not in ahead]
    return Rotation(needed, itertools.chain(first, rest, queue), ahead, None)
