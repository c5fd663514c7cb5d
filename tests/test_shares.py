"""Fair shares across tenants (scheduler_svc/policy/shares.py), on the real Scheduler with a
small pool: what a tenant notices when another floods the server.

* A tenant under its share is seated ahead of a tenant over it, and the over-share
  tenant's running request is the one rotated out for it; never the other way round.
* Service counts by weight, VTC's token weights, plus device memory under `shares`.
* Nothing is banked: a tenant back from idle starts level with the tenants at work, and
  a tenant alone gets every seat (work-conserving).
* Blame: the tenants whose requests held the device while a missed request sat queued.
* With one tenant every decision is the policy's own.
"""

from __future__ import annotations

import pytest

from common.contracts import ExecuteResult
from gateway.metrics import GatewayMetrics
from proto import scheduler_pb2
from scheduler_svc.interfaces import SchedulerOutput
from scheduler_svc.loop import LoopStats
from scheduler_svc.policy import RotationLimits, make_policy
from scheduler_svc.policy.shares import FAIRNESS, OUTPUT_WEIGHT, PROMPT_WEIGHT, Ledger
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.service import service_counters


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def req(rid: str, tenant: str, arrival: float, prompt: int = 8, weight: float = 1.0,
        slo: SLO | None = None, max_tokens: int = 100) -> Request:
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival, slo=slo or SLO(5.0, 1.0), tenant=tenant, weight=weight)


def scheduler(fairness: str, device_blocks: int, t: float = 0.0, max_batched_tokens: int = 64,
              max_num_seqs: int = 256, policy: str = "lvf") -> tuple[Scheduler, Clock]:
    clock = Clock(t)
    config = SchedulerConfig(num_device_blocks=device_blocks, num_host_blocks=64, block_size=4,
                             max_batched_tokens=max_batched_tokens, eager_budget_blocks=0,
                             max_num_seqs=max_num_seqs, fairness=fairness)
    policy = make_policy(policy, limits=RotationLimits.bare())
    return Scheduler(config, policy, clock=clock), clock


def step(sched: Scheduler, clock: Clock, dt: float = 0.05) -> SchedulerOutput:
    out = sched.schedule()
    if out.transfers is not None:
        sched.complete_transfer(out.transfers.fence)
    clock.t += dt
    sampled = {c.request_id: 7 for c in out.chunks if c.sample}
    sched.update_from_output(out, ExecuteResult(sampled, execute_s=dt))
    sched.check_integrity()
    return out


def flooded(fairness: str) -> tuple[Scheduler, Clock]:
    """B has run alone for a while and holds both seats (max_num_seqs 2), two more of its
    requests waiting; then A's first request arrives, lagging less than B's."""
    sched, clock = scheduler(fairness, device_blocks=64, max_num_seqs=2)
    for i in range(4):  # all lag: their TTFT SLO is tight
        sched.add_request(req(f"b{i}", "B", 0.0, prompt=11, slo=SLO(0.5, 0.05)))
    for _ in range(12):
        step(sched, clock)
    assert len(sched.running) == 2 and all(r.tenant == "B" for r in sched.running)
    sched.add_request(req("a0", "A", clock.t, prompt=9, slo=SLO(5.0, 1.0)))
    return sched, clock


def test_the_tenant_under_its_share_is_seated_and_the_one_over_it_rotated_out() -> None:
    sched, clock = flooded("shares")
    # No credit either way: A starts level with B (B's past service is no debt of A's)...
    assert sched.shares.key("A") == sched.shares.key("B")
    outs = [step(sched, clock) for _ in range(3)]
    # ... and once B's tokens count more than A's seat will, A is under its share: seated
    # for a B request, and it keeps the seat (no trading it back).
    assert any("a0" in [c.request_id for c in o.chunks] for o in outs)
    rotated = [r for o in outs for r in o.rotated_out]
    assert rotated and all(sched.requests[r].tenant == "B" for r in rotated)
    for _ in range(5):
        assert "a0" in [c.request_id for c in step(sched, clock).chunks]
    # LVF's order across tenants (global): B's lagging requests keep the seats.
    sched, clock = flooded("global")
    for _ in range(8):
        assert "a0" not in [c.request_id for c in step(sched, clock).chunks]


def test_a_tenant_under_its_share_is_not_preempted_for_one_over_it() -> None:
    """A runs one request; B, far over its share, waits with a lagging candidate: A keeps
    its seat, though LVF alone would rotate it out for the laggard."""
    for fairness, kept in (("shares", True), ("global", False)):
        sched, clock = scheduler(fairness, device_blocks=6)
        sched.add_request(req("b0", "B", 0.0, prompt=11, max_tokens=6))
        for _ in range(8):  # B is served alone: its counter climbs
            step(sched, clock)
        sched.add_request(req("a0", "A", clock.t, prompt=7, slo=SLO(5.0, 1.0)))
        step(sched, clock)
        assert sched.requests["a0"] in sched.running
        # B's new request lags hard (0.5 s TTFT SLO), A's decode has seconds of slack.
        sched.add_request(req("b1", "B", clock.t - 0.4, prompt=15, slo=SLO(0.5, 1.0)))
        out = step(sched, clock)
        assert ("a0" not in out.rotated_out) is kept, fairness


def test_service_counts_tokens_by_weight_and_memory_only_under_shares() -> None:
    for mode in FAIRNESS:
        led = Ledger(mode, num_device_blocks=100)
        a, b = req("a", "A", 0.0, weight=2.0), req("b", "B", 0.0)
        led.add(a)
        led.add(b)
        a.num_computed_tokens = 8  # its whole prompt of 8, this iteration
        b.num_computed_tokens, b.output_token_ids = 9, [1]  # a decode
        led.charge(0.0, {}, {}, ())
        led.charge(1.0, {"a": 8, "b": 1}, {"a": a, "b": b}, [("A", 50), ("B", 10)])
        tokens = {"A": 8 * PROMPT_WEIGHT / 2.0, "B": OUTPUT_WEIGHT}
        if mode == "global":
            assert led.counter == {"A": 0.0, "B": 0.0}
            continue
        # rate: 10 weighted tokens a second; a block-second is worth rate / 100 tokens.
        memory = {"A": 50 * 0.1 / 2.0, "B": 10 * 0.1} if mode == "shares" else {"A": 0, "B": 0}
        assert led.counter == pytest.approx({t: tokens[t] + memory[t] for t in tokens})
        assert led.block_s == {"A": 50.0, "B": 10.0}
        assert led.shares()["A"]["block_seconds"] == pytest.approx(50 / 60)


def test_no_credit_is_banked_and_a_tenant_alone_gets_every_seat() -> None:
    sched, clock = scheduler("shares", device_blocks=64)
    sched.add_request(req("a0", "A", 0.0, max_tokens=2))
    sched.add_request(req("b0", "B", 0.0, max_tokens=40))
    while "a0" in sched.requests:
        step(sched, clock)
    for _ in range(30):  # A idle: B alone, every seat and token its own
        out = step(sched, clock)
        assert [c.request_id for c in out.chunks] == ["b0"]
    assert sched.shares.key("B") > sched.shares.key("A") + 30
    sched.add_request(req("a1", "A", clock.t))
    # A comes back level with B, not 30 iterations of credit ahead.
    assert sched.shares.key("A") == pytest.approx(sched.shares.key("B"))


def test_one_tenant_decides_as_the_policy_alone() -> None:
    runs = {}
    for fairness in FAIRNESS:
        sched, clock = scheduler(fairness, device_blocks=10, max_batched_tokens=16)
        for i in range(6):
            sched.add_request(req(f"r{i}", "", 0.1 * i, prompt=9 + i, slo=SLO(0.3 + 0.2 * i, 1.0)))
        runs[fairness] = [
            (tuple(c.request_id for c in o.chunks), tuple(o.rotated_out))
            for o in (step(sched, clock) for _ in range(40))]
        assert not sched.shares.accounting
    assert runs["shares"] == runs["global"] == runs["vtc"]


def test_blame_names_the_tenant_that_held_the_device() -> None:
    """A's request waits while B's hold every block, past its TTFT SLO: its miss blames B,
    on the scheduler's counters and on /metrics (tenant, behind)."""
    sched, clock = scheduler("global", device_blocks=6, policy="fcfs")  # preempts nobody
    sched.add_request(req("b0", "B", 0.0, prompt=11, max_tokens=40))
    step(sched, clock)
    sched.add_request(req("a0", "A", clock.t, prompt=15, slo=SLO(0.2, 1.0), max_tokens=2))
    while "a0" in sched.requests:
        step(sched, clock)
    a0 = next(r for r in sched.collect_finished() if r.request_id == "a0")
    assert a0.first_token_time - a0.arrival_time > 0.2  # it missed
    assert set(a0.missed_blame) == {"B"} and a0.missed_blame["B"] > 0.2
    stats = LoopStats()
    stats.count_slo(a0, clock.t)
    counters = {**stats.as_dict(), **service_counters(sched.shares)}
    assert counters["slo_miss_blame_s:B@A"] == pytest.approx(a0.missed_blame["B"])
    assert counters["service_tokens@B"] > 0 and counters["device_block_seconds@B"] > 0
    text = GatewayMetrics().render(scheduler_pb2.StatsReply(counters=counters), "m").decode()
    assert 'superinfer_slo_miss_blame_seconds_total{behind="B",tenant="A"}' in text
    assert 'superinfer_tenant_device_block_seconds_total{tenant="B"}' in text


def test_a_tenant_alone_blames_its_own_requests() -> None:
    """One named tenant bursting: its misses name its own requests (no other tenant)."""
    sched, clock = scheduler("shares", device_blocks=6, policy="fcfs")
    for i in range(3):
        sched.add_request(req(f"a{i}", "A", 0.0, prompt=11, slo=SLO(0.2, 1.0), max_tokens=20))
    while sched.has_unfinished():
        step(sched, clock)
    done = sched.collect_finished()
    late = [r for r in done if r.first_token_time - r.arrival_time > 0.2]
    assert late and all(set(r.missed_blame) == {"A"} for r in late)
