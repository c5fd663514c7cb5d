"""vLLM's request priority in every policy's order: strict classes, the policy's own
order within each.

A request's `priority` (vLLM's convention: lower is served first; 0 by default; the
gateway bounds it by its tenant's own) puts it in a *class*. The rule, for every policy:

* Candidates (waiting and rotary requests) come class by class, most urgent first, and
  none of a less urgent class is seated in an iteration that passed over a candidate of a
  more urgent one. Within a class the policy's own order and rules apply unchanged (LVF's
  lag, the baselines' arrival order and ranks, the skipping of a candidate that does not
  fit); across classes the class decides, however little a more urgent request lags.
* Running requests are ordered the same way, so victims, taken from the tail, come from
  the least urgent class first: for a running request that needs a block (reactive
  preemption, as in vLLM's priority scheduling) and for a candidate.
* A running request is never preempted for a candidate of a less urgent class; within a
  class the policy's `may_preempt` decides; for a candidate of a more urgent class it may
  be preempted whatever the policy's own rule says (as vLLM 0.6's priority scheduling
  did; fcfs, which preempts for no candidate of one class, then preempts too).
  Why not the policy's word there too: victims then come in an order where, once one may
  not be displaced, no later one may, for this candidate or any after it, which the
  admission walk relies on; and a less urgent request never keeps a seat from a more
  urgent one merely by lagging more. The rest stays the policy's and the mechanism's:
  whether an iteration rotates at all (LVF: only where a candidate would miss its
  deadline waiting for seats that finishing requests free), a victim's minimum residency,
  B_xfer.

Cost: the queues file each request under (class, the policy's group) (`order_key`), so
each sorted run holds one class, and the merge goes class by class, lazily (`merged`):
the keys of a class are computed only once the walk reaches it. With every live request
of class 0 the runs, the merge and every decision are the policy's own, unchanged.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator

from scheduler_svc.policy.base import OrderKey, Policy
from scheduler_svc.policy.merge import merge
from scheduler_svc.policy.shares import Ledger
from scheduler_svc.queue import Entry
from scheduler_svc.request import Request

_priority = operator.attrgetter("priority")


def order_key(policy: Policy, req: Request, rotary: bool) -> OrderKey:
    """The policy's (group, static key), with the request's class and tenant in front of
    the group (each sorted run holds one class of one tenant: policy/shares.py)."""
    group, key = policy.order_key(req, rotary)
    return (req.priority, req.tenant, group), key


def classes(runs: list[list[Entry]]) -> list[list[list[Entry]]]:
    """Sorted runs of one class each, by class, most urgent first (each class's runs in
    their given order)."""
    by_class: dict[int, list[list[Entry]]] = {}
    for run in runs:
        if run:
            by_class.setdefault(run[0][2].priority, []).append(run)
    if len(by_class) <= 1:
        return list(by_class.values())
    return [by_class[p] for p in sorted(by_class)]


def merged(runs: list[list[Entry]], key: Callable[[Request, float], tuple[object, ...]],
           now: float, ledger: Ledger | None = None) -> Iterator[Request]:
    """The candidates of sorted runs of one class each (`order_key`'s), class by class, each
    in `key` order: the lazy form of `classes_first(policy.candidates(...))`. With a
    `ledger` whose tenants contend, each class comes tenant by tenant (policy/shares.py)."""
    per_class = merge if ledger is None or not ledger.contended else ledger.interleave
    split = classes(runs)
    if len(split) <= 1:
        return per_class(split[0] if split else [], key, now)
    return itertools.chain.from_iterable(per_class(c, key, now) for c in split)


def classes_first(order: list[Request]) -> list[Request]:
    """`order` class by class, most urgent first, each class in its given order (the list
    itself where all are of one class)."""
    if not order:
        return order
    first = order[0].priority
    if all(r.priority == first for r in order):
        return order
    return sorted(order, key=_priority)  # stable: each class keeps its order


def may_displace(policy: Policy, victim: Request, candidate: Request, now: float,
                 ledger: Ledger | None = None) -> bool:
    """May running `victim` be preempted for `candidate`? Never for a less urgent class,
    for a more urgent one yes, within a class as the policy's `may_preempt` says."""
    if victim.priority != candidate.priority:
        return victim.priority > candidate.priority
    across = None if ledger is None else ledger.displaces(victim, candidate)
    return policy.may_preempt(victim, candidate, now) if across is None else across
