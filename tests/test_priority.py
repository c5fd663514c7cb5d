"""vLLM's request priority in the scheduler's order (policy/priority.py): strict classes,
lower first, each policy's own order within a class; on hand-built requests and on a
Scheduler with a small block pool."""

from __future__ import annotations

import random

import pytest

from common.contracts import ExecuteResult
from scheduler_svc.interfaces import SchedulerOutput
from scheduler_svc.policy import POLICY_NAMES, RotationLimits, make_policy
from scheduler_svc.policy.base import Policy
from scheduler_svc.policy.merge import merge
from scheduler_svc.policy.priority import classes, classes_first, may_displace, merged, order_key
from scheduler_svc.policy.rotation import rotation_needed
from scheduler_svc.policy.state import RotationInputs
from scheduler_svc.queue import RequestQueue
from scheduler_svc.request import SLO, Request, RequestState, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def req(rid: str, arrival: float, priority: int = 0, state: RequestState = RequestState.WAITING,
        last_token: float | None = None, slo: SLO | None = None, prompt: int = 8,
        max_tokens: int = 100) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                arrival, slo=slo or SLO(5.0, 0.1), priority=priority, tenant="acme")
    r.state = state
    if last_token is not None:
        r.first_token_time = r.last_token_time = last_token
        r.output_token_ids = [1]
    return r


def ids(reqs: object) -> list[str]:
    return [r.request_id for r in reqs]  # type: ignore[attr-defined]


def lazy_order(policy: Policy, waiting: list[Request], rotary: list[Request],
               now: float) -> list[Request]:
    """The scheduler's candidate order: queues filed by class, merged class by class."""
    w = RequestQueue(lambda r: order_key(policy, r, False))
    q = RequestQueue(lambda r: order_key(policy, r, True))
    for r in waiting:
        w.append(r)
    for r in rotary:
        q.append(r)
    runs = policy.candidate_runs(w.groups() + q.groups(), now)
    return list(merged(runs, policy.merge_key, now))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_more_urgent_class_comes_first_however_late_it_came(name: str) -> None:
    now = 10.0
    older = req("older", 6.0, priority=5)
    old = req("old", 6.5, priority=5)
    urgent = req("urgent", 9.0, priority=0)  # arrived last: under LVF it lags least
    parked = req("parked", 0.0, priority=5, state=RequestState.ROTARY, last_token=9.97)
    parked0 = req("parked0", 0.0, priority=0, state=RequestState.ROTARY, last_token=9.98)
    policy = make_policy(name)
    waiting, rotary = [older, old, urgent], [parked, parked0]
    own = policy.candidates(waiting, rotary, now)
    assert own.index(urgent) > own.index(older)  # on its own the policy serves it later
    got = lazy_order(policy, waiting, rotary, now)
    assert [r.priority for r in got] == [0, 0, 5, 5, 5]
    # Within each class, the policy's own order.
    for p in (0, 5):
        assert ids(r for r in got if r.priority == p) == ids(r for r in own if r.priority == p)
    assert ids(got) == ids(classes_first(own))


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("mixed", [False, True])
def test_lazy_order_is_the_policy_own_within_classes(name: str, mixed: bool) -> None:
    """Every request of class 0: the runs, and so the lazy merge, are the policy's own,
    and the order is its `candidates()`. Mixed classes: the same, class by class."""
    rng = random.Random(11)
    policy = make_policy(name)
    for trial in range(20):
        now = 100.0
        if trial % 2:
            policy.observe_iteration(rng.choice([0.01, 0.05, 0.2]))
        policy.set_lag_unit(rng.choice([None, 20.0]))
        waiting: list[Request] = []
        rotary: list[Request] = []
        for i in range(rng.randint(1, 50)):
            arrival = round(rng.uniform(0, now), 1)
            parked = rng.random() < 0.4
            r = req(f"t{trial}-{i}", arrival, priority=rng.choice([0, 1, 5]) if mixed else 0,
                    state=RequestState.ROTARY if parked else RequestState.WAITING,
                    last_token=round(rng.uniform(arrival, now), 1) if parked else None,
                    slo=SLO(rng.choice([1.0, 5.0, 20.0]), rng.choice([0.05, 0.1, 0.5])))
            (rotary if parked else waiting).append(r)
        own = policy.candidates(waiting, rotary, now)
        got = lazy_order(policy, waiting, rotary, now)
        if not mixed:
            assert ids(got) == ids(own)
            # One run per policy group, as without priorities: the merge stays as lazy.
            plain_w = RequestQueue(lambda r: policy.order_key(r, False))
            filed_w = RequestQueue(lambda r: order_key(policy, r, False))
            for r in waiting:
                plain_w.append(r)
                filed_w.append(r)
            assert classes(filed_w.groups()) == ([plain_w.groups()] if waiting else [])
        else:
            assert ids(got) == ids(classes_first(own))


def test_may_displace_never_for_a_less_urgent_class() -> None:
    now = 10.0
    policy = make_policy("fcfs")  # never preempts for a candidate of its own class
    # Decodes with 4.5 s of slack; candidates 4.5 s into their 5 s TTFT SLO.
    running0 = req("r0", 0.0, priority=0, state=RequestState.RUNNING, last_token=9.5,
                   slo=SLO(5.0, 5.0))
    running5 = req("r5", 0.0, priority=5, state=RequestState.RUNNING, last_token=9.5,
                   slo=SLO(5.0, 5.0))
    cand0, cand5 = req("c0", 5.5, priority=0), req("c5", 5.5, priority=5)
    assert may_displace(policy, running5, cand0, now)
    assert not may_displace(policy, running0, cand5, now)
    assert not may_displace(policy, running0, cand0, now)  # the policy's word within a class
    lvf = make_policy("lvf", limits=RotationLimits.bare())
    assert lvf.may_preempt(running0, cand5, now)  # LVF alone would rotate it out ...
    assert not may_displace(lvf, running0, cand5, now)  # ... but not for a less urgent one


# -- on the Scheduler ----------------------------------------------------------------------


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def scheduler(policy: Policy, device_blocks: int, t: float = 10.0,
              max_batched_tokens: int = 32) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock(t)
    config = SchedulerConfig(num_device_blocks=device_blocks, num_host_blocks=16, block_size=4,
                             max_batched_tokens=max_batched_tokens, eager_budget_blocks=0)
    return Scheduler(config, policy, clock=clock), clock


def step(sched: Scheduler) -> SchedulerOutput:
    """One iteration: plan it, copy its blocks, and land a token for each sampled chunk."""
    out = sched.schedule()
    if out.transfers is not None:
        sched.complete_transfer(out.transfers.fence)
    sampled = {c.request_id: 7 for c in out.chunks if c.sample}
    sched.update_from_output(out, ExecuteResult(sampled, execute_s=0.05))
    sched.check_integrity()
    return out


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_scheduler_admits_the_more_urgent_request_of_a_tenant_first(name: str) -> None:
    """Memory for one prompt of 9 tokens (3 of 4 blocks): the request of priority 0 gets it,
    though it came last and (LVF) lags least; no request of priority 5 is seated."""
    sched, _ = scheduler(make_policy(name), device_blocks=4)
    for i, arrival in enumerate([6.0, 6.2, 6.4]):  # on time, lagging more
        sched.add_request(req(f"low{i}", arrival, priority=5, prompt=9))
    sched.add_request(req("urgent", 9.9, priority=0, prompt=9))
    assert not sched.everything_fits()
    out = step(sched)
    assert [c.request_id for c in out.chunks] == ["urgent"]
    assert ids(sched.running) == ["urgent"]


def test_plain_fcfs_iterations_serve_the_more_urgent_class_first() -> None:
    """Everything fits (LVF runs deadline order): a token budget for one prompt goes to the
    request of priority 0, though the other's deadline is earlier."""
    sched, _ = scheduler(make_policy("lvf"), device_blocks=64, max_batched_tokens=8)
    sched.add_request(req("low", 0.0, priority=5))
    sched.add_request(req("urgent", 5.0, priority=0))
    assert sched.everything_fits()
    assert [c.request_id for c in step(sched).chunks] == ["urgent"]


@pytest.mark.parametrize(("name", "victim", "candidate", "displaced"), [
    ("lvf", 0, 5, False),  # never for a less urgent candidate ...
    ("lvf", 0, 0, True),  # ... though LVF on its own rotates it out here
    ("lvf", 5, 0, True),
    ("fcfs", 5, 0, True),  # recomputed for a more urgent one ...
    ("fcfs", 0, 0, False),  # ... though fcfs preempts nobody for a candidate of its class
    ("fcfs", 0, 5, False),
])
def test_a_running_request_yields_only_to_a_more_urgent_class_or_its_policy(
        name: str, victim: int, candidate: int, displaced: bool) -> None:
    """A decode holds 2 of 4 blocks; a lagging candidate needs 3 (LVF keeps a block for the
    decode's growth)."""
    sched, clock = scheduler(make_policy(name, limits=RotationLimits.bare()), device_blocks=4)
    # Its TBT SLO of 1 s leaves it tens of seconds of slack: a victim for LVF.
    sched.add_request(req("a", 10.0, priority=victim, slo=SLO(5.0, 1.0), prompt=7))
    step(sched)
    clock.t = 10.1
    # 4.5 s into its 5 s TTFT SLO: on time, lagging far more than the decode.
    sched.add_request(req("b", 5.6, priority=candidate, prompt=9))
    out = step(sched)
    assert ("a" in out.rotated_out + out.recomputed) is displaced
    assert ("b" in [c.request_id for c in out.chunks]) is displaced
    assert sched.requests["a"].state is (
        RequestState.RUNNING if not displaced
        else RequestState.ROTARY if name == "lvf" else RequestState.WAITING)


def test_victims_come_from_the_least_urgent_class_first() -> None:
    """Two decodes; LVF on its own would rotate out the one with more slack (priority 0).
    The one of priority 5 goes instead."""
    sched, clock = scheduler(make_policy("lvf", limits=RotationLimits.bare()), device_blocks=6)
    sched.add_request(req("ahead0", 10.0, priority=0, slo=SLO(5.0, 1.0), prompt=7))
    sched.add_request(req("behind5", 10.0, priority=5, slo=SLO(5.0, 0.2), prompt=7))
    step(sched)
    clock.t = 10.1
    order = sched.policy.running_order(sched.running.list(), clock.t)
    assert ids(order)[-1] == "ahead0"  # the policy's own first victim
    sched.add_request(req("b", 5.6, priority=0, prompt=7))
    out = step(sched)
    assert out.rotated_out == ["behind5"]
    assert sched.requests["ahead0"].state is RequestState.RUNNING
    assert "b" in [c.request_id for c in out.chunks]


@pytest.mark.parametrize(("small", "seated"), [(0, True), (5, False)])
def test_a_passed_over_class_holds_back_the_less_urgent_ones(small: int, seated: bool) -> None:
    """A prompt of priority 0 too large for the free blocks, with nobody to displace (the
    decode is within its residency): LVF skips it, and seats the small prompt after it
    only where that one is of its class."""
    sched, clock = scheduler(make_policy("lvf"), device_blocks=4)
    sched.add_request(req("decode", 10.0, priority=0, prompt=7))
    step(sched)
    clock.t = 10.1
    sched.add_request(req("large", 9.0, priority=0, prompt=9))
    sched.add_request(req("small", 9.5, priority=small, prompt=3))
    out = step(sched)
    assert "large" not in [c.request_id for c in out.chunks]
    assert ("small" in [c.request_id for c in out.chunks]) is seated
    assert not out.rotated_out and not out.recomputed


@pytest.mark.parametrize(("parked_priority", "first"), [(0, "parked"), (5, "new")])
def test_parked_first_never_jumps_a_more_urgent_class(parked_priority: int, first: str) -> None:
    policy = make_policy("lvf", limits=RotationLimits(parked_first=True))
    policy.gap_s = 0.01
    now = 100.0
    new = req("new", now - 1.0, priority=0, prompt=3)  # 4 s of slack: it can wait
    parked = req("parked", 0.0, priority=parked_priority, state=RequestState.ROTARY,
                 last_token=now - 0.05)
    assert policy.slack_s(parked, now) is not None  # on time
    s = RotationInputs(policy, running=8, seat_limit=8, block_size=4,
                       finish_rate=lambda _now, _window: 10.0)
    got = rotation_needed(s, iter([new, parked]), now)
    assert not got.needed
    assert ids(got.queue)[0] == first


def test_static_running_order_is_by_class_then_admission() -> None:
    """The baselines' running order (last admitted is the first victim) within a class."""
    policy = make_policy("swapped-first")
    running = RequestQueue(policy.running_key)
    for i, p in enumerate([5, 0, 5, 0]):
        r = req(f"r{i}", float(i), priority=p, state=RequestState.RUNNING)
        r.admitted_iteration = i
        running.append(r)
    order = classes_first(list(merge(running.live_groups(), policy.running_merge_key, 1.0)))
    assert ids(order) == ["r1", "r3", "r0", "r2"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_without_priorities_the_scheduler_admits_in_the_policy_own_order(name: str) -> None:
    """Every request of class 0, of mixed SLO classes: memory for two prompts, and the two
    seated are the head of the policy's own `candidates()`."""
    rng = random.Random(3)
    policy = make_policy(name)
    sched, clock = scheduler(policy, device_blocks=4)
    waiting = [req(f"w{i}", round(rng.uniform(8.0, 9.9), 2),
                   slo=SLO(rng.choice([2.0, 5.0]), 0.1)) for i in range(8)]
    for r in waiting:
        sched.add_request(r)
    own = ids(policy.candidates(waiting, [], clock.t))
    assert own != sorted(own)  # not simply arrival order
    step(sched)
    assert ids(sched.running) == own[:2]
