"""The one small interface every scheduling policy implements.

The scheduler (scheduler_svc/scheduler.py) owns the mechanics: token budget, blocks,
transfers. A policy only orders requests and says who may displace whom, so each policy
is a few pure functions a test can call on hand-built requests.

Ordering is split in two so that it stays cheap with thousands of live requests:

* `order_key(req)` puts a queued request in a *group* with a *static key*. Within a
  group, ascending static key is the policy's order at every moment (for LVF, requests
  of one SLO class lag in the order they arrived or last got a token), so a queue keeps
  each group sorted as requests enter (`RequestQueue`, O(log n)).
* `merge_key(req, now)` orders requests across groups. The scheduler merges the sorted
  groups lazily and evaluates it only for the requests it actually looks at.

`candidates()` and `running_order()` are the same order computed the plain way (one sort
over everything): the definition the lazy merge must equal, and what tests call.

A policy orders requests of one priority class: the scheduler applies its orders class by
class, most urgent first, and decides across classes itself (policy/priority.py).

Admission asks the policy at each decision point (`plain_fcfs`, `may_swap_in`,
`on_unservable`, `may_preempt`, `swaps_out`): small pure methods of a request and the time,
so a test can call each with hand-built requests, and the scheduler has no policy flags.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.queue import Entry
from scheduler_svc.request import Request, RequestState

if TYPE_CHECKING:
    from scheduler_svc.policy.state import Queue

OrderKey = tuple[Hashable, tuple[float | int | str, ...]]


@dataclass(slots=True, frozen=True)
class RotationLimits:
    """LVF's rules for who may displace whom, at the values the engine runs.

    None of these is a server setting (common/scheduling.py holds those): each default is
    the rule the measurements chose (docs/rotasched.md says which, and why); the
    experiments vary them through the simulator's policy specs. B_xfer is the exception:
    the engine fills it from `--xfer-budget-blocks` or the measured link (None here:
    unlimited)."""

    xfer_budget_blocks: int | None = None  # B_xfer: blocks rotated in+out per iteration
    # Iterations a (re)admitted request is safe from proactive preemption (chosen in the
    # simulator: docs/results/simulator/).
    min_residency: int = 32
    # ... or, on, LVF's ceiling for a residency that falls as waiting requests turn late
    # (policy/residency.py). Off: on a rate step it won 1.6 of the 5 points a shorter
    # residency wins at 2x, and on Llama-3-8B at 100 req/s it thrashed (rotations x2.4,
    # TTFT -2.2 points; docs/results/rotasched/, "The residency adapted online").
    adapt_residency: bool = False
    vlt_margin: float = 0.0  # a victim must lag at least this much less than the candidate
    # Anti-starvation for policies that skip unservable candidates: a waiting request with
    # no token yet whose VLT reaches this is no longer skipped: admission stops there, so
    # free blocks gather for it instead of going to later, smaller requests (None: off).
    hold_vlt: float | None = -0.5
    # Iteration-time-aware admission: an iteration may take at most this share of the
    # tightest live TBT SLO (the scheduler needs a cost model to apply it). None: the
    # policy's default (LVF 0.9, the baselines none); 0: off.
    iteration_budget: float | None = None
    # Seats are counted so that the prompts of on-time new requests can be prefilled
    # within this share of their TTFT SLO (LVF; see LVFPolicy.prefill_demand).
    prefill_within: float = 0.5
    # Rotate only where a candidate would miss its deadline waiting for seats that
    # finishing requests free (a policy with `lazy_rotation`; policy/rotation.py),
    # less a margin of this share of its TTFT SLO for the wait's variance.
    lazy_rotation: bool = True
    lazy_margin: float = 0.25
    # ... and where none is needed, parked candidates go ahead of new ones for as many
    # seats as the new ones can spare by that estimate (off: measured, it shortens stalls
    # on the CPU stack and costs TPOT under sustained overload in the simulator).
    parked_first: bool = False
    # A started request may be rotated out for a candidate only where its slack covers
    # this many times the mean time parked requests of its SLO class have spent parked
    # before coming back (LVF, `observe_park`): parked for that long, one with less would
    # miss its TPOT. None: off (at 1 it moved TTFT misses into TPOT misses: as many
    # must-show cells failed, a different set; docs/results/rotasched/).
    park_cover: float | None = None
    # Where seats are not waited for, a parked request coming back early into free blocks
    # leaves this share of what the running requests grow by until the next finish
    # (policy/rotation.py, which says why a half; 0: none, every free block serves).
    growth_room: float = 0.5
    # Where the seat a candidate needs is held by memory or max_num_seqs, not by the
    # iteration-time budget (`Policy.time_bound` False), it must lag its victim by this
    # much more (LVF; in lag units). There rotation only moves who waits: every rotation
    # is a missed gap and a stay parked that TPOT pays for. Where the budget holds the
    # seat, the batch is compute-bound and slack alone decides. 6: every must-show cell of
    # the simulator passes (0: four fail on TPOT), at 1 % of the goodput summed over them
    # (docs/results/rotasched/, "A margin where the batch time does not hold the seat").
    memory_margin: float = 6.0

    def __post_init__(self) -> None:
        if self.xfer_budget_blocks is not None and self.xfer_budget_blocks < 0:
            raise ValueError(f"xfer_budget_blocks must be >= 0 (None: unlimited), got "
                             f"{self.xfer_budget_blocks}")
        if self.min_residency < 0:
            raise ValueError(f"min_residency must be >= 0, got {self.min_residency}")
        if self.iteration_budget is not None and not 0.0 <= self.iteration_budget <= 1.0:
            raise ValueError(f"iteration_budget must be in [0, 1] (0: off), got "
                             f"{self.iteration_budget}")
        if not 0.0 < self.prefill_within <= 1.0:
            raise ValueError(f"prefill_within must be in (0, 1], got {self.prefill_within}")
        if not self.lazy_margin >= 0.0:
            raise ValueError(f"lazy_margin must be >= 0, got {self.lazy_margin}")
        if self.park_cover is not None and not self.park_cover > 0.0:
            raise ValueError(f"park_cover must be positive (None: off), got {self.park_cover}")
        if not self.growth_room >= 0.0:
            raise ValueError(f"growth_room must be >= 0, got {self.growth_room}")
        if not self.memory_margin >= 0.0:
            raise ValueError(f"memory_margin must be >= 0, got {self.memory_margin}")

    @classmethod
    def bare(cls, **rules: object) -> RotationLimits:
        """The mechanism without LVF's guards (no residency, hold or memory margin), but
        `rules`: vLLM's baselines run with it, and tests that look at one rule at a time."""
        return cls(**{"min_residency": 0, "hold_vlt": None, "memory_margin": 0.0, **rules})  # type: ignore[arg-type]


BARE_LIMITS = RotationLimits.bare()


class Unservable(enum.Enum):
    """What admission does with a candidate it cannot serve this iteration."""

    STOP = "stop"  # strict order: admit nobody after it (vLLM)
    SKIP = "skip"  # serve the candidates after it; its lag keeps growing meanwhile


class Policy(ABC):
    name: str = "?"
    # Whether preempted requests may park their KV in host memory at all (rotary). False:
    # preemption always recomputes, and synced blocks get no eager host copies.
    uses_host_pool: bool = True
    limits: RotationLimits = BARE_LIMITS
    # Whether B_xfer bounds its rotations (`--xfer-budget-blocks`; vLLM's fcfs and
    # swapped-first have no such bound).
    bounded_transfers: bool = False
    # Share of the tightest TBT SLO an iteration may take when limits do not say (None:
    # no time target, vLLM's behaviour).
    default_iteration_budget: float | None = None
    # The unit, in seconds, of the lags a VLT counts where live requests carry different
    # SLOs (the scheduler sets it: set_lag_unit); None: each request's own TTFT SLO.
    lag_unit_s: float | None = None
    # The time between tokens a request gets when served, where the policy follows it
    # from the executed batches (LVF: observe_iteration); None: not followed.
    gap_s: float | None = None
    # Whether `running_key` orders the running requests at every moment. False: their
    # order changes with time however they are grouped, and the scheduler sorts them by
    # `running_merge_key` each iteration (a batch's seats, not the backlog).
    static_running_order: bool = True
    # Whether the policy preempts for a candidate only where its slack (`slack_s`) will not
    # cover the wait for seats that finishing requests free (limits.lazy_rotation turns it
    # off).
    lazy_rotation: bool = False
    # The scheduler's word, for the candidate it asks `may_preempt` about: whether every
    # seat is taken because the iteration-time budget allows no more (True), rather than
    # memory or max_num_seqs (limits.memory_margin).
    time_bound: bool = False

    def set_lag_unit(self, unit_s: float | None) -> None:
        """The scheduler's word, whenever the live requests' TTFT SLOs change: one unit
        for every lag where they differ (the longest of them), None where they are one."""
        self.lag_unit_s = unit_s

    # -- admission decisions (the scheduler asks; defaults are vLLM's behaviour) ------------
    def plain_fcfs(self, everything_fits: bool) -> bool:
        """Run this iteration as plain FCFS with chunked prefill and no rotation?
        `everything_fits`: every live request, with its next token, fits the device pool."""
        return False

    def swaps_out(self, victim: Request) -> bool:
        """Preempting `victim`: park its KV in host memory (True) or recompute it later?"""
        return self.uses_host_pool

    def may_swap_in(self, candidate: Request, preempted_this_iteration: bool) -> bool:
        """May rotary `candidate` come back in this iteration?"""
        return True

    def iteration_target_s(self, tightest_tbt_s: float) -> float | None:
        """The longest an iteration should take, given the tightest live TBT SLO (None:
        no time target, only the token budget: vLLM's behaviour, the baselines' default)."""
        share = self.limits.iteration_budget
        if share is None:
            share = self.default_iteration_budget
        return share * tightest_tbt_s if share else None

    def prefill_demand(self, waiting: Iterable[list[Entry]], now: float) -> float:
        """Prompt tokens per second the waiting requests need (`waiting`: the waiting
        queue's sorted runs). Decode seats leave room for them under a time target."""
        return 0.0

    def growth_reserve_blocks(self, num_running: int, block_size: int) -> int:
        """Free device blocks admission leaves alone, for the running requests to grow
        into (0: admit into every free block, vLLM's behaviour)."""
        return 0

    def observe_iteration(self, seconds: float) -> bool:
        """A batch ran for `seconds`: the time between tokens its running requests got.
        True: the queued requests' `order_key`s changed (the scheduler re-files them)."""
        return False

    def min_residency(self, waiting: Queue, running: int, now: float) -> int:
        """Iterations a (re)admitted request is safe from proactive rotation now (LVF
        adapts it to the late requests in `waiting`)."""
        return self.limits.min_residency

    def observe_park(self, req: Request, now: float) -> None:
        """Rotary `req` comes back onto the device at `now`, parked since
        `req.state_since` (a policy that weighs rotations by the stays keeps them)."""
        return None

    def observe_finish(self, req: Request) -> None:
        """`req` finished (its `finish_reason` set): a policy that counts on the output
        lengths of finished requests keeps them."""
        return None

    def candidate_runs(self, runs: list[list[Entry]], now: float) -> list[list[Entry]]:
        """The queues' sorted runs, split where the merge key's order needs it (each
        returned run must be sorted by `merge_key` at `now`)."""
        return runs

    def slack_s(self, candidate: Request, now: float) -> float | None:
        """Seconds `candidate` may still wait and meet the SLO it waits on (None: it
        cannot any more). Asked only of a policy with `lazy_rotation`."""
        return None

    def prompt_batches_s(self, candidate: Request, chunk_tokens: int) -> float:
        """How much of its slack `candidate` spends on prompt batches beyond the one its
        slack already counts, at `chunk_tokens` prompt tokens a batch. Asked only of a
        policy with `lazy_rotation`."""
        return 0.0

    def on_unservable(self, candidate: Request, now: float) -> Unservable:
        """`candidate` does not fit and nobody may be preempted for it: stop or skip?"""
        return Unservable.STOP

    # -- candidates: waiting and rotary requests, most deserving first ---------------------
    @abstractmethod
    def order_key(self, req: Request, rotary: bool) -> OrderKey:
        """(group, static key) of a waiting (`rotary=False`) or rotary request."""

    @abstractmethod
    def merge_key(self, req: Request, now: float) -> tuple[float | int | str, ...]:
        """Sort key of a candidate at `now`, comparable across groups (smallest first)."""

    # -- running requests, most deserving first; victims come from the tail ----------------
    @abstractmethod
    def running_key(self, req: Request) -> OrderKey:
        """(group, static key) of a running request."""

    @abstractmethod
    def running_merge_key(self, req: Request, now: float) -> tuple[float | int | str, ...]:
        """Sort key of a running request at `now` (smallest first)."""

    def candidates(self, waiting: list[Request], rotary: list[Request], now: float) -> list[Request]:
        """Requests to bring onto the device, most deserving first."""
        return sorted(waiting + rotary, key=lambda r: self.merge_key(r, now))

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        """Running requests, most deserving first; preemption victims come from the tail."""
        return sorted(running, key=lambda r: self.running_merge_key(r, now))

    def may_preempt(self, victim: Request, candidate: Request, now: float) -> bool:
        """May `victim` be rotated out to make room for `candidate` (proactive preemption)?

        Victims are offered from the tail of `running_order`; once one may not be
        preempted, no later one may either (the scheduler stops asking)."""
        return False


def arrival_key(req: Request) -> tuple[float, str]:
    return (req.arrival_time, req.request_id)


def admission_key(req: Request) -> tuple[int, float, str]:
    """Oldest admission first: the last admitted is the first victim (vLLM's rule)."""
    return (req.admitted_iteration, req.arrival_time, req.request_id)


def deadline_key(req: Request) -> tuple[float, float, str]:
    return (req.arrival_time + req.slo.ttft_s, req.arrival_time, req.request_id)


def deadline_order(reqs: list[Request]) -> list[Request]:
    """Earliest TTFT deadline first: FCFS within an SLO class (one class: arrival order).

    The order of LVF's plain-FCFS iterations (`plain_fcfs`). With one SLO class it is
    arrival order; with classes of different TTFT SLOs, arrival order handed the token
    budget to a batch-class prompt (20 s SLO) that had waited 2 s while interactive ones
    (1 s) went late behind it with memory and seats to spare (measured in the simulator,
    gh200 artifact settings, 20 req/s, `--slo-classes mixed`: docs/results/rotasched/)."""
    return sorted(reqs, key=deadline_key)


class StaticOrderPolicy(Policy):
    """A policy whose orders never change with time: the group's key is the sort key."""

    def merge_key(self, req: Request, now: float) -> tuple[float | int | str, ...]:
        return self.order_key(req, req.state is RequestState.ROTARY)[1]

    def running_key(self, req: Request) -> OrderKey:
        return 0, admission_key(req)

    def running_merge_key(self, req: Request, now: float) -> tuple[float | int | str, ...]:
        return admission_key(req)
