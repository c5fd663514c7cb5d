"""The scheduling decisions in policy/ driven from hand-built state: no Scheduler and no
BlockManager, only policy/state.py's types (a pool of counted blocks, queues of requests),
so each rule can be checked where it decides."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from scheduler_svc.policy import RotationLimits, make_policy
from scheduler_svc.policy.admission import admit
from scheduler_svc.policy.base import Policy
from scheduler_svc.policy.rotation import LAZY_MIN_FINISHES, rotation_needed
from scheduler_svc.policy.running import schedule_running
from scheduler_svc.policy.shares import Ledger
from scheduler_svc.policy.state import Plan, RotationInputs
from scheduler_svc.policy.victims import pick_victims
from scheduler_svc.queue import Entry
from scheduler_svc.request import SLO, Request, RequestState, SamplingParams

BS = 4  # tokens per block


def _request(rid: str, prompt: int, state: RequestState = RequestState.WAITING,
             arrival: float = 0.0, computed: int = 0) -> Request:
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=64, ignore_eos=True), arrival,
                slo=SLO(5.0, 0.1))
    r.num_computed_tokens = computed
    r.set_state(state, arrival)
    return r


def _ahead(rid: str, now: float) -> Request:
    """A running request 4 prompt + 4 output tokens long (2 blocks), its 4 tokens streamed
    in 0.2 s against a 0.1 s TBT SLO: ahead of its pace, a victim for a lagging one."""
    r = _request(rid, 4, RequestState.RUNNING, arrival=now - 0.3, computed=8)
    r.output_token_ids.extend([5] * 4)
    r.first_token_time, r.last_token_time = now - 0.2, now - 0.01
    r.run_start_time = now - 0.3
    return r


@dataclass
class Table:
    device: list[int | None]


@dataclass
class Pool:
    """Counted device blocks, one table per request: the block manager's arithmetic."""

    free: int
    tables: dict[str, Table] = field(default_factory=dict)
    num_late_swap_in: int = 0
    caches_device_blocks: bool = False
    same_iteration_reuse: bool = True
    prefix_caching: bool = False

    @property
    def num_free_for_compute(self) -> int:
        return self.free

    @property
    def num_free_for_swap_in(self) -> int:
        return self.free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // BS)

    def held(self, req: Request) -> int:
        t = self.tables.get(req.request_id)
        return 0 if t is None else len(t.device)

    def try_grow(self, req: Request, n: int) -> bool:
        need = self.blocks_for(req.num_computed_tokens + n) - self.held(req)
        if need > self.free:
            return False
        self.free -= max(0, need)
        self.tables.setdefault(req.request_id, Table([])).device += [0] * max(0, need)
        return True

    def admission(self, req: Request, budget: int) -> tuple[int, int, int]:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        return n, self.blocks_for(req.num_computed_tokens + n) - self.held(req), 0

    def num_device_blocks_of(self, req: Request) -> int:
        return self.held(req)

    def preemption_blocks(self, req: Request, rotate: bool) -> tuple[int, int, int]:
        return 0, self.held(req), 0

    def released_by_preempting(self, req: Request, rotate: bool) -> tuple[int, int]:
        return self.held(req), 0


class Queue:
    def __init__(self, policy: Policy, rotary: bool, requests: list[Request]) -> None:
        self.policy, self.rotary, self.items = policy, rotary, list(requests)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.items)

    def list(self) -> list[Request]:
        return list(self.items)

    def groups(self) -> list[list[Entry]]:
        keyed = sorted((self.policy.order_key(r, self.rotary), i, r)
                       for i, r in enumerate(self.items))
        return [[(k, i, r) for k, i, r in keyed]] if keyed else []

    live_groups = groups

    def min_tokens(self) -> int | None:
        return min((r.num_tokens for r in self.items), default=None)

    def append(self, r: Request) -> None:
        self.items.append(r)

    def remove(self, r: Request) -> None:
        self.items.remove(r)


class State:
    """A scheduler as the decisions see it (policy/state.py's SchedulingState)."""

    block_size = BS
    pipelined = False

    def __init__(self, policy: Policy, pool: Pool, running: list[Request],
                 waiting: list[Request], seats: int = 8) -> None:
        self.policy, self.blocks = policy, pool
        self.seat_limit = self.max_num_seqs = seats
        self.iteration = 100
        self.shares = Ledger("shares", pool.free + 64)  # one tenant: no effect
        self.speculator = None  # no speculative decoding
        self.running = Queue(policy, False, running)
        self.waiting = Queue(policy, False, waiting)
        self.rotary = Queue(policy, True, [])
        self.preempted: list[str] = []
        for r in running:
            pool.tables[r.request_id] = Table([0] * pool.blocks_for(r.num_computed_tokens))

    def rotation_inputs(self) -> RotationInputs:
        return RotationInputs(self.policy, len(self.running), self.seat_limit, BS,
                              lambda now, window: 100.0)

    def preempt(self, victim: Request, plan: Plan) -> None:
        self.running.remove(victim)
        self.blocks.free += len(self.blocks.tables.pop(victim.request_id).device)
        plan.budget += plan.tokens.pop(victim.request_id, 0)
        plan.preempted = True
        plan.displaced.add(victim.request_id)
        victim.set_state(RequestState.WAITING, plan.now)
        self.waiting.append(victim)
        self.preempted.append(victim.request_id)

    def admit(self, q: Request, n: int, plan: Plan) -> bool:
        self.waiting.remove(q)
        assert self.blocks.try_grow(q, n)
        q.set_state(RequestState.RUNNING, plan.now)
        q.admitted_iteration = self.iteration
        self.running.append(q)
        return True

    def count_growth_preemption(self) -> None:
        pass

    def count_parked_preemptions(self, n: int) -> None:
        pass


def _lvf() -> Policy:
    return make_policy("lvf", limits=RotationLimits.bare(lazy_rotation=False, min_residency=0))


def test_running_requests_take_their_tokens_and_the_tail_makes_room() -> None:
    """Two decodes whose next token starts a new block, one free block: the first grows
    into it, the second preempts the last request in the order (the third)."""
    pool = Pool(free=1)
    a, b, c = (_request(x, 8, RequestState.RUNNING, computed=8) for x in "abc")
    a.output_token_ids.append(5)  # 9 tokens: a decode into block 3
    b.output_token_ids.append(5)
    state = State(_lvf(), pool, [a, b, c], [])
    plan = Plan(now=1.0, budget=64)
    schedule_running(state, [a, b, c], plan)
    assert plan.tokens == {"a": 1, "b": 1} and state.preempted == ["c"]


def test_admission_seats_who_fits_and_preempts_only_when_the_candidate_then_fits() -> None:
    """LVF with every seat taken: a candidate 4.95 s into its 5 s TTFT SLO takes the seat of
    a request ahead of its pace; one too large for the victim's blocks preempts nobody (a
    rotation that serves nobody only costs transfers). (A candidate already past its
    deadline would preempt nobody either: it is served from free capacity only.)"""
    policy = _lvf()
    now = 60.0
    victim = _ahead("victim", now)
    lagging = _request("lagging", 8, arrival=now - 4.95)  # 2 blocks: fits the victim's 2
    # One free block, which LVF keeps for the running requests to grow into.
    state = State(policy, Pool(free=1), [victim], [lagging], seats=1)
    assert policy.growth_reserve_blocks(1, BS) == 1
    plan = Plan(now=now, budget=64)
    admit(state, [victim], plan, fcfs_mode=False)
    assert state.preempted == ["victim"] and plan.tokens == {"lagging": 8}

    victim2 = _ahead("victim2", now)
    huge = _request("huge", 40, arrival=now - 4.95)  # 10 blocks: more than any victim frees
    state = State(policy, Pool(free=1), [victim2], [huge], seats=1)
    plan = Plan(now=now, budget=64)
    admit(state, [victim2], plan, fcfs_mode=False)
    assert state.preempted == [] and plan.tokens == {}


def test_victims_are_taken_lowest_first_until_the_candidate_fits_within_b_xfer() -> None:
    policy = make_policy("lvf", limits=RotationLimits.bare(xfer_budget_blocks=None))
    now = 60.0
    vs = [_ahead(f"v{i}", now) for i in range(3)]
    q = _request("q", 14, arrival=now - 4.95)  # 4 blocks: two victims' worth
    state = State(policy, Pool(free=0), vs, [q])
    chosen = pick_victims(state, q, need=4, rotary=False, cost=0, victims=vs,
                          plan=Plan(now=now, budget=64))
    assert [v.request_id for v in chosen or []] == ["v0", "v1"]
    assert pick_victims(state, q, need=7, rotary=False, cost=0, victims=vs,
                        plan=Plan(now=now, budget=64)) is None  # all three free only 6


def _candidate(rid: str, slack_s: float, now: float) -> Request:
    """A new request whose TTFT deadline is `slack_s` away (two 10 ms batches aside)."""
    return _request(rid, 3, arrival=now - 5.0 + slack_s + 0.02)


@pytest.mark.parametrize("rate, slacks, needed", [
    (10.0, [4.0, 4.0], False),  # 0.1 s a seat: both wait for one with seconds to spare
    (10.0, [4.0, 0.2], True),  # the second's slack is under the wait plus the margin
    (1.0, [4.0, 4.0], True),  # 5 finishes in the SLO < LAZY_MIN_FINISHES: rotate now
])
def test_rotation_is_needed_only_where_a_candidate_cannot_wait_for_a_seat(
        rate: float, slacks: list[float], needed: bool) -> None:
    policy = make_policy("lvf")
    policy.gap_s = 0.01  # the batch time the policy counts batches in
    now = 100.0
    cands = [_candidate(f"c{i}", s, now) for i, s in enumerate(slacks)]
    for c in cands:
        assert policy.slack_s(c, now) == pytest.approx(
            slacks[cands.index(c)], abs=0.05)
    s = RotationInputs(policy, running=8, seat_limit=8, block_size=BS,
                       finish_rate=lambda _now, _window: rate)
    got = rotation_needed(s, iter(cands), now)
    assert got.needed is needed
    assert [r.request_id for r in got.queue] == [c.request_id for c in cands]  # all put back
    if rate * 5.0 < LAZY_MIN_FINISHES:
        assert got.parked_within_s == pytest.approx(policy.limits.lazy_margin * 5.0)
    assert not math.isnan(got.growth_blocks_per_seat)
