"""RotaSched's behaviour under overload: iteration-time-aware admission, the free-block watermark,
SLO-miss attribution, vLLM's goodput, SLO classes, and the α/β directions of DESIGN §4.

The simulator runs are small (gh200-96gb + Qwen2.5-32B, 30 s of arrivals, seed 0), each a
few seconds; their results are computed once per module.
"""

from __future__ import annotations

import math

import pytest

from common.contracts import ExecuteResult
from scheduler_svc.policy import RotationLimits, VLTParams, make_policy
from scheduler_svc.policy.iteration_cost import OnlineIterationCost, seqs_within, tokens_within
from scheduler_svc.policy.lvf import LVFPolicy
from scheduler_svc.policy.rotation import rotation_needed
from scheduler_svc.request import PHASES, SLO, Request, RequestState, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.slo_attribution import HISTOGRAM_KEYS, MissHistograms, base_key
from superinfer.sim.engine import PolicyVariant, SimConfig, Simulator
from superinfer.sim.profile import load_hardware, load_model
from superinfer.slo_metrics import RequestRecord, SLOMetrics, compute_metrics
from superinfer.workload import (
    SLO_MIXES,
    SLOClass,
    WorkloadError,
    WorkloadSpec,
    build_trace,
    parse_slo_classes,
)

QWEN = load_model("qwen2.5-32b")


# -- the iteration cost ------------------------------------------------------------------------
class Linear:
    """t = 5 ms + 0.1 ms per token + 1 ns per token of context."""

    ready = True

    def seconds(self, tokens: int, seqs: int, context: int) -> float:
        return 0.005 + 1e-4 * tokens + 1e-9 * context

    def observe(self, tokens: int, seqs: int, context: int, seconds: float) -> None:
        pass


def test_cost_inversions_are_the_largest_batches_under_the_target() -> None:
    c = Linear()
    n = tokens_within(c, 0.05, 10, 1000, 4096)
    assert c.seconds(n, 10, 1000 + n) <= 0.05 < c.seconds(n + 1, 10, 1001 + n)
    assert tokens_within(c, 1.0, 10, 1000, 512) == 512  # the token budget binds first
    assert tokens_within(c, 0.001, 10, 1000, 512) == 0
    k = seqs_within(c, 0.05, 500.0, 4096, reserve=100)
    assert c.seconds(k + 100, k, k * 501 + 100) <= 0.05 < c.seconds(k + 101, k + 1,
                                                                     (k + 1) * 501 + 100)


def test_online_cost_learns_the_executors_times() -> None:
    fit = OnlineIterationCost()
    assert not fit.ready
    truth = Linear()
    shapes = [(t, s, ctx) for t in (1, 8, 64, 300, 512) for s in (1, 8, 64) for ctx in (100, 10**5)]
    for tokens, seqs, ctx in shapes * 3:
        fit.observe(tokens, seqs, ctx, truth.seconds(tokens, seqs, ctx))
    assert fit.ready
    for tokens, seqs, ctx in [(10, 10, 5000), (400, 200, 80_000)]:
        assert fit.seconds(tokens, seqs, ctx) == pytest.approx(truth.seconds(tokens, seqs, ctx),
                                                               rel=0.02)
    with pytest.raises(ValueError, match="forgetting factor"):
        OnlineIterationCost(lam=0.0)


def _busy(policy: str, cost: object, n: int = 40) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(num_device_blocks=4096, num_host_blocks=0, block_size=16,
                        max_batched_tokens=8192, max_num_seqs=1024, eager_budget_blocks=0),
        make_policy(policy), clock=lambda: 0.0, cost=cost,  # type: ignore[arg-type]
    )
    for i in range(n):
        sched.add_request(Request(f"r{i}", [1] * 200, SamplingParams(max_tokens=50), 0.0,
                                  slo=SLO(5.0, 0.1)))
    return sched


def test_lvf_keeps_the_iteration_under_its_share_of_the_tbt_slo() -> None:
    """40 prompts of 200 tokens fit one 8192-token batch (0.8 s at 0.1 ms a token); LVF with a
    cost model plans batches of at most 0.9 · 100 ms; the baselines keep vLLM's token budget."""
    c = Linear()
    lvf = _busy("lvf", c)
    out = lvf.schedule()
    assert c.seconds(out.num_tokens, len(out.chunks), out.num_tokens) <= 0.09
    assert out.num_tokens == tokens_within(c, 0.09, 0, 0, 8192)
    sf = _busy("swapped-first", c)
    assert sf.schedule().num_tokens == 8000
    # Without a cost model (or before the fit is ready) the token budget alone applies.
    assert _busy("lvf", None).schedule().num_tokens == 8000
    # An executor whose fixed cost per batch takes half the target: no trade possible.
    slow = Linear()
    slow.seconds = lambda t, s, ctx: 0.05 + 1e-4 * t  # type: ignore[method-assign]
    assert _busy("lvf", slow).schedule().num_tokens == 8000


def _roofline_batches(near_fit: bool) -> list[float]:
    """LVF with an online fit, on an executor that is memory-bound for small batches (20 ms)
    and compute-bound for large ones (60 us a token); between two planned batches the fit
    also sees 20 decode-only batches, as a serving fit mostly does. The planned batches'
    real times."""
    fit = OnlineIterationCost(min_batches=1)
    lvf = _busy("lvf", fit, n=200)
    if not near_fit:
        lvf.near_cost = None

    def real(tokens: int) -> float:
        return max(0.02, 6e-5 * tokens)

    times = []
    for _ in range(60):
        for k in range(20):
            fit.observe(20 + k, 20 + k, 5000, real(20 + k))
        out = lvf.schedule()
        t = real(out.num_tokens)
        times.append(t)
        lvf.update_from_output(out, ExecuteResult({ch.request_id: 7 for ch in out.chunks
                                                   if ch.sample}, execute_s=t))
    return times


def test_lvf_budgets_large_batches_with_a_fit_of_the_large_batches() -> None:
    """One line fitted over all batches, mostly small decodes, underestimates the large ones
    a time budget plans: they run past the 0.9 * 100 ms target (by 2-7 %: in the simulator,
    9-26 % and past the SLO, every running request's gap missed). Once the fit of the
    batches near the target has 8 of them, the planned batches land on the target."""
    alone = _roofline_batches(near_fit=False)
    assert sum(t > 0.091 for t in alone[:24]) >= 15  # the 200 prompts take ~24 batches
    near = _roofline_batches(near_fit=True)
    assert all(t <= 0.09 + 1e-9 for t in near[9:])
    assert sum(t >= 0.085 for t in near[9:24]) >= 12  # large batches still, not small ones


def test_lvf_leaves_a_free_block_per_running_request_for_growth() -> None:
    limits = RotationLimits.bare(min_residency=0)
    lvf = make_policy("lvf", VLTParams(), limits)
    assert lvf.growth_reserve_blocks(37, 16) == 37
    assert all(make_policy(p).growth_reserve_blocks(37, 16) == 0
               for p in ("fcfs", "swapped-first", "waiting-first"))


def _two_seats(limits: RotationLimits) -> tuple[Scheduler, list[float]]:
    """LVF with two seats, both taken by long decodes far ahead of their pace."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_device_blocks=64, num_host_blocks=64, block_size=4,
                                      max_num_seqs=2, pipelined=False),
                      make_policy("lvf", VLTParams(), limits), clock=lambda: clock[0])
    for rid in ("r1", "r2"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True),
                                  arrival_time=0.0, slo=SLO(5.0, 1.0)))
    for _ in range(3):
        _step(sched, clock)
    return sched, clock


def _step(sched: Scheduler, clock: list[float]) -> None:
    out = sched.schedule()
    if out.transfers is not None:
        sched.complete_transfer(out.transfers.fence)
    sched.update_from_output(out, ExecuteResult({c.request_id: 7 for c in out.chunks if c.sample},
                                                execute_s=0.01))
    clock[0] += 0.01


def _finishing_four_a_second(limits: RotationLimits) -> tuple[Scheduler, float, float]:
    """_two_seats at 10.5 s, with 4 requests a second finished over the last 10 s; returns
    the scheduler, now and LVF's time between tokens."""
    sched, _ = _two_seats(limits)
    now = 10.5
    for i in range(1, 10 * 4 + 1):
        sched.turnover.record(now - 10.0 + i / 4)
    assert sched.turnover.rate(now, 5.0) == pytest.approx(4.0)
    gap = sched.policy.gap_s
    assert gap is not None
    return sched, now, gap


def _new_with_slack(sched: Scheduler, now: float, gap: float, slack: float, rid: str = "new",
                    prompt: int = 3) -> Request:
    """A waiting request (5 s TTFT SLO) whose deadline, two batches before it, is `slack`
    seconds away."""
    r = Request(rid, [4] * prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                arrival_time=now - 5.0 + 2 * gap + slack, slo=SLO(5.0, 1.0))
    r.set_state(RequestState.WAITING, now)
    assert sched.policy.slack_s(r, now) == pytest.approx(slack)
    return r


@pytest.mark.parametrize("limits, per_s, rotates_at", [
    (RotationLimits.bare(lazy_rotation=False), 4, 10.0),  # it lags more than the running ones
    (RotationLimits.bare(lazy_margin=0.0), 4, 14.8),  # 0.18 s of slack left, under the 0.25 s wait
    (RotationLimits.bare(lazy_margin=0.25), 4, 13.6),  # 1.38 s left, under 0.25 s + 0.25 * 5 s
    (RotationLimits.bare(), 2, 10.0),  # 10 finishes per 5 s SLO: too few to wait for
])
def test_lvf_rotates_only_when_finishing_requests_would_not_seat_a_candidate_in_time(
        limits: RotationLimits, per_s: int, rotates_at: float) -> None:
    """Seats full, requests finishing at `per_s` a second: a new request (5 s TTFT SLO, its
    deadline two 10 ms batches earlier) waits for a seat to free while its slack covers
    that wait (1 / per_s) and the margin; LVF preempts for it once it does not. Without
    lazy rotation, or with under 16 finishes per TTFT SLO to wait for, at once."""
    sched, clock = _two_seats(limits)
    last = 5.0

    def finishing(upto: float) -> None:  # as from a fuller batch
        nonlocal last
        for i in range(1, round((upto - last) * per_s) + 1):
            sched.turnover.record(last + i / per_s)
        last = upto

    new = Request("new", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True),
                  arrival_time=10.0, slo=SLO(5.0, 1.0))
    for t in (10.0, 13.0, 13.6, 14.0, 14.6, 14.8):
        clock[0] = t
        finishing(t)
        assert sched.turnover.rate(t, 5.0) == pytest.approx(per_s)  # over the candidate's S_B
        if t == 10.0:
            sched.add_request(new)
        _step(sched, clock)
        rotated = t >= rotates_at
        assert (new.state is RequestState.RUNNING) is rotated, t
        assert sched.stats.rotations == int(rotated), t
        if rotated:
            break


def test_where_too_few_finish_a_parked_request_preempts_only_near_its_deadline() -> None:
    """Two seats, three decodes, no request finishing (LVF rotates without waiting for
    seats): the third takes a seat at once, and the request it parked comes back only
    once its slack is under lazy_margin (0.25) of its 5 s TTFT SLO. Before, it took back
    the seat of the running request with more slack, which then took it back in turn: on
    the real stack two thirds of LVF's rotations (docs/results/rotasched/)."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_device_blocks=128, num_host_blocks=256, block_size=4,
                                      max_num_seqs=2, pipelined=False),
                      make_policy("lvf", VLTParams(), RotationLimits.bare()), clock=lambda: clock[0])
    for i, rid in enumerate(("r1", "r2", "r3")):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True),
                                  arrival_time=0.01 * i, slo=SLO(5.0, 1.0)))
        _step(sched, clock)
    for _ in range(150):  # 1.5 s
        _step(sched, clock)
    assert sched.stats.rotations == 1
    (parked,) = [r for r in sched.requests.values() if r.state is RequestState.ROTARY]
    running = [r for r in sched.requests.values() if r.state is RequestState.RUNNING]
    slack = sched.policy.slack_s(parked, clock[0])
    assert slack is not None and all(sched.policy.slack_s(r, clock[0]) > slack + 1.0
                                     for r in running)
    clock[0] += slack - 1.3  # still over 1.25 s: it waits
    _step(sched, clock)
    assert parked.state is RequestState.ROTARY and sched.stats.rotations == 1
    clock[0] += 0.2  # 1.1 s left: it takes the seat of the one with the most slack
    _step(sched, clock)
    assert parked.state is RequestState.RUNNING and sched.stats.rotations == 2


@pytest.mark.parametrize("finished_per_s, room, resumes", [
    (2.5, 1.0, False), (7.0, 1.0, True), (1.0, 1.0, True), (2.5, 0.5, True), (2.5, 0.0, True)])
def test_a_parked_request_not_yet_due_comes_back_only_where_the_running_can_grow(
        finished_per_s: float, room: float, resumes: bool) -> None:
    """Two seats, four requests of 72-token prompts, 16 blocks of 16 tokens, 10 ms
    batches, a 2 s TTFT SLO and fewer than 16 finishes in it (LVF rotates without waiting
    for seats). A seat frees while the requests parked have seconds of slack and one fits
    the free blocks. The running pair then grows by 1/(rate · 10 ms · 16) blocks each
    until the next finish: at ~2.5 finishes a second more than the free blocks, and they
    stay parked (one preempts once its slack is under lazy_margin); at ~7 a second one
    comes back. Before, one came back at once, and on the real stack the running
    requests' growth then parked one of them: LVF's growth preemptions were 1-2x
    waiting-first's (docs/results/rotasched/). Under 4 finishes in the SLO (~1 a
    second: a run's first seconds) the rate is not trusted, and it comes back as before.
    `growth_room` keeps that share of the growth: at a half, the room at ~2.5 finishes a
    second fits beside it, and it comes back."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_device_blocks=16, num_host_blocks=256,
                                      block_size=16, max_num_seqs=2, pipelined=False),
                      make_policy("lvf", VLTParams(), RotationLimits.bare(growth_room=room)),
                      clock=lambda: clock[0])
    for i, rid in enumerate(("r1", "r2", "r3", "r4")):
        sched.add_request(Request(rid, [1] * 72, SamplingParams(max_tokens=1000,
                                                                ignore_eos=True),
                                  arrival_time=0.01 * i, slo=SLO(2.0, 1.0)))
        _step(sched, clock)
    for _ in range(10):
        _step(sched, clock)
    parked = [r for r in sched.requests.values() if r.state is RequestState.ROTARY]
    running = [r for r in sched.requests.values() if r.state is RequestState.RUNNING]
    assert len(parked) == 2 and len(running) == 2
    rotations = sched.stats.rotations
    clock[0] += 5.0
    for i in range(round(2 * finished_per_s)):  # finishes over the last 2 s
        sched.turnover.record(clock[0] - 2.0 + (i + 1) / finished_per_s)
    assert sched.abort(running[0].request_id)
    assert not sched.everything_fits()
    for r in parked:
        slack = sched.policy.slack_s(r, clock[0])
        assert slack is not None and slack > 0.5  # not yet due (lazy_margin of 2 s)
    assert min(sched.bm.blocks_for(r.num_tokens) for r in parked) + 1 \
        <= sched.bm.num_free_for_compute
    _step(sched, clock)
    back = [r for r in parked if r.state is RequestState.RUNNING]
    assert len(back) == resumes
    assert sched.stats.rotations == rotations and sched.stats.growth_preemptions == 0


def test_a_parked_request_near_its_deadline_does_not_make_lvf_rotate() -> None:
    """Seats full, 4 finishes a second. A new request with 4.5 s of its 5 s TTFT SLO left
    heads LVF's order; second comes a request that must not wait past 0.3 s: new, LVF
    rotates for it (0.5 s to its seat + the 1.25 s margin), but parked, not: a rotation
    would seat the new request at the head and park another running one (on the real
    stack at 1.5x saturation, such rotations parked 56-81 requests per pass)."""
    sched, now, gap = _finishing_four_a_second(RotationLimits.bare())
    head = _new_with_slack(sched, now, gap, 4.5 - 2 * gap, "head")  # arrived at 10 s

    def second(state: RequestState) -> Request:
        r = Request("second", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True),
                    arrival_time=0.0, slo=SLO(5.0, 0.1))
        if state is RequestState.ROTARY:  # 10 tokens out, first at 9 s: due at 10.8 s
            r.first_token_time = 9.0
            r.output_token_ids.extend([7] * 10)
        else:  # its TTFT deadline 0.3 s away (two 10 ms batches before 10.82 s)
            r.arrival_time = 5.82
        r.set_state(state, 9.5)
        return r

    for state, needed in ((RequestState.WAITING, True), (RequestState.ROTARY, False)):
        r = second(state)
        assert sched.policy.slack_s(r, now) == pytest.approx(0.3)
        assert rotation_needed(sched.rotation_inputs(), iter([head, r]), now)[0] is needed, state


@pytest.mark.parametrize("seat_limit, needed", [(2, False), (1, True)])
def test_lvf_counts_the_running_requests_over_the_seat_limit_before_a_seat_frees(
        seat_limit: int, needed: bool) -> None:
    """Seats full, 4 finishes a second, a new request with 1.6 s of slack: the first seat
    that frees is its in 0.25 s, within its slack less the 1.25 s margin. Where the time
    budget's seat limit has fallen to one under two running requests, the first finish
    frees no seat: its seat comes in 0.5 s, past that, and LVF rotates for it (counted
    from k alone, interactive requests in the simulator waited for seats that were not
    coming and missed their 1 s TTFT)."""
    sched, now, gap = _finishing_four_a_second(RotationLimits.bare())
    new = _new_with_slack(sched, now, gap, 1.6)
    sched.seat_limit = seat_limit  # as _time_budget sets it from a slower batch
    assert rotation_needed(sched.rotation_inputs(), iter([new]), now)[0] is needed


@pytest.mark.parametrize("chunk_tokens, needed", [(0, False), (100, False), (4, True)])
def test_lvf_counts_a_long_prompts_batches_against_its_slack(chunk_tokens: int,
                                                             needed: bool) -> None:
    """Seats full, 4 finishes a second, a new request with a 100-token prompt and 1.6 s of
    slack: its seat frees in 0.25 s, within its slack less the 1.25 s margin, where its
    prompt fits the batch's prompt tokens (its deadline leaves a batch for it). At 4
    tokens a batch the prompt takes 24 more batches (0.24 s at 10 ms) and LVF rotates for
    it (in the simulator, interactive requests with 1,024-token prompts were admitted on
    time, took 7 batches to prefill and missed their 1 s TTFT SLO)."""
    sched, now, gap = _finishing_four_a_second(RotationLimits.bare())
    assert gap == pytest.approx(0.01)
    new = _new_with_slack(sched, now, gap, 1.6, prompt=100)
    assert rotation_needed(sched.rotation_inputs(), iter([new]), now, chunk_tokens)[0] is needed


@pytest.mark.parametrize("head_slack, parked_first, first", [
    (4.5, True, "parked"),  # the new request can spare (4.5 - 1.25) * 4 - 1 = 12 seats
    (1.6, True, "head"),  # (1.6 - 1.25) * 4 - 1 = 0.4: not one
    (4.5, False, "head"),  # off: the policy's order
])
def test_parked_requests_go_ahead_of_new_ones_that_can_spare_the_seats(
        head_slack: float, parked_first: bool, first: str) -> None:
    """Seats full, 4 finishes a second, no rotation needed. A parked request that has
    streamed goes ahead of the new one that heads LVF's order where the new one's slack
    covers the extra seat (on the real stack at 1.5x, LVF seated new requests with 8-9 s
    of a 10 s SLO left while parked ones stalled), and admission holds blocks for it."""
    sched, now, gap = _finishing_four_a_second(RotationLimits.bare(parked_first=parked_first))
    head = _new_with_slack(sched, now, gap, head_slack, "head")
    parked = Request("parked", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True),
                     arrival_time=0.0, slo=SLO(5.0, 1.0))
    parked.first_token_time = 9.0
    parked.output_token_ids.extend([7] * 10)
    parked.set_state(RequestState.ROTARY, 9.5)
    assert sched.policy.slack_s(head, now) == pytest.approx(head_slack)
    needed, queue, hold, *_ = rotation_needed(sched.rotation_inputs(), iter([head, parked]), now)
    assert not needed
    order = [q.request_id for q in queue]
    assert order[0] == first and sorted(order) == ["head", "parked"]
    assert hold == (frozenset({"parked"}) if first == "parked" else frozenset())


def _two_decodes_until_b_parks(limits: RotationLimits) -> tuple[Scheduler, list[float]]:
    """LVF on eight device blocks: decodes a and b grow until it parks b for a's growth.
    Returns the scheduler and its clock."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_device_blocks=8, num_host_blocks=64, block_size=4,
                                      max_num_seqs=4, pipelined=False),
                      make_policy("lvf", VLTParams(), limits), clock=lambda: clock[0])
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(1, 9)),
                                  SamplingParams(max_tokens=40, ignore_eos=True),
                                  arrival_time=0.0, slo=SLO(5.0, 1.0)))
    while sched.requests["b"].state is not RequestState.ROTARY:
        _step(sched, clock)
    return sched, clock


@pytest.mark.parametrize("parked_first", [True, False])
def test_a_new_request_is_not_seated_past_a_parked_one_that_goes_first(
        parked_first: bool) -> None:
    """Eight device blocks: two decodes grow until LVF parks one (b). A new request with
    its whole TTFT SLO left fits the free blocks and b does not. With parked_first, b goes
    first and the free blocks wait for it (seating the new one would take them); off, the
    new request is seated past it."""
    sched, clock = _two_decodes_until_b_parks(RotationLimits.bare(parked_first=parked_first))
    assert sched.requests["a"].state is RequestState.RUNNING
    now = clock[0]
    for j in range(40):  # finishes often enough to wait for (Scheduler.LAZY_MIN_FINISHES)
        sched.turnover.record(now * j / 40)
    sched.add_request(Request("n", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True),
                              arrival_time=now, slo=SLO(5.0, 1.0)))
    free = sched.bm.num_free_for_compute
    assert 1 <= free < sched.bm.admission(sched.requests["b"], 512)[1]  # n fits, b does not
    _step(sched, clock)
    assert sched.requests["b"].state is RequestState.ROTARY
    n_state = sched.requests["n"].state
    assert n_state is (RequestState.WAITING if parked_first else RequestState.RUNNING)


def test_preemptions_are_counted_by_what_they_were_for() -> None:
    """Eight device blocks, two decodes: LVF parks b so that a can grow (a growth
    preemption). With no minimum residency and no request finishing, b, lagging more than
    a, comes back once its slack is under lazy_margin of its TTFT SLO by taking a's place:
    a preemption to seat a parked request, one started request traded for another (the
    simulator prints the split; measured at gh200 defaults, 20 req/s: 1,215 of LVF's 2,214
    rotations, where waiting-first rotated 977 times, all for new ones)."""
    sched, clock = _two_decodes_until_b_parks(RotationLimits.bare(min_residency=0))
    st = sched.stats
    assert (st.preemptions, st.growth_preemptions, st.parked_preemptions) == (1, 1, 0)
    slack = sched.policy.slack_s(sched.requests["b"], clock[0])
    assert slack is not None and slack > 0.25 * 5.0
    clock[0] += slack - 1.0
    for _ in range(10):
        _step(sched, clock)
        if sched.requests["b"].state is RequestState.RUNNING:
            break
    assert sched.requests["a"].state is RequestState.ROTARY
    assert (st.preemptions, st.growth_preemptions, st.parked_preemptions) == (2, 1, 1)


def test_lvf_learns_how_long_parked_requests_stay_parked() -> None:
    """The scheduler tells the policy each resumed request's stay parked; LVF keeps a
    moving mean of them (what --park-cover weighs a victim's slack against)."""
    sched, clock = _two_decodes_until_b_parks(RotationLimits.bare(min_residency=0))
    b = sched.requests["b"]
    parked_at, lvf = b.state_since, sched.policy
    assert isinstance(lvf, LVFPolicy) and lvf.park_s(b.slo) is None
    while b.state is RequestState.ROTARY:
        resumed_at = clock[0]
        _step(sched, clock)
    assert resumed_at > parked_at
    assert lvf.park_s(b.slo) == pytest.approx(resumed_at - parked_at)
    lvf.observe_park(b, b.state_since + 1.0)  # a second stay, of 1 s: a tenth of the way
    assert lvf.park_s(b.slo) == pytest.approx(0.9 * (resumed_at - parked_at) + 0.1)


def test_turnover_leaves_idle_spells_out_of_the_rate() -> None:
    """Four finishes in the first 4 s, then nothing live until 30 s: at 31 s the rate over
    5 s reaches back over the idle spell (0.8 a second), not 0 (which made LVF rotate
    eagerly at the start of every burst that followed an idle server)."""
    from scheduler_svc.turnover import Turnover
    t = Turnover(max_window_s=60.0)
    t.start(0.0)
    for x in (1.0, 2.0, 3.0, 4.0):
        t.record(x)
    t.stop(4.0)
    assert t.rate(10.0, 5.0) == pytest.approx(4 / 4)  # idle since 4 s: 4 s of history
    t.start(30.0)
    assert t.rate(31.0, 5.0) == pytest.approx(4 / 5)  # 1 s now + 4 s before the spell
    t.record(31.0)
    assert t.rate(31.0, 1.0) == pytest.approx(1.0)  # the last busy second alone
    t.stop(31.0)
    t.start(40.0)
    assert t.rate(41.0, 3.0) == pytest.approx(2 / 3)  # 1 s + 1 s + 1 s, both spells out


def test_turnover_counts_finishes_per_second_over_the_window() -> None:
    from scheduler_svc.turnover import Turnover
    t = Turnover(max_window_s=10.0)
    assert t.rate(5.0, 5.0) == 0.0  # not started: no history
    t.start(0.0)
    for x in (1.0, 2.0, 3.0):
        t.record(x)
    assert t.rate(4.0, 5.0) == pytest.approx(3 / 4)  # 4 s of history so far
    t.record(9.0)
    assert t.rate(10.0, 5.0) == pytest.approx(1 / 5)  # only 9.0 in (5, 10]
    t.record(25.0)  # drops everything older than 15 s
    assert t.rate(25.0, 30.0) == pytest.approx(1 / 10)


class PerToken:
    """t = 5 ms + `per_token` per token in the batch."""

    ready = True

    def __init__(self, per_token: float) -> None:
        self.per_token = per_token

    def seconds(self, tokens: int, seqs: int, context: int) -> float:
        return 0.005 + self.per_token * tokens

    def observe(self, tokens: int, seqs: int, context: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("memory_margin", [0.0, 6.0])
def test_lvf_frees_every_seat_a_candidate_needs_when_the_seat_limit_drops(
        memory_margin: float) -> None:
    """Six decodes run, far ahead of their pace. The executor slows: ten tokens fit the
    90 ms target, and a waiting prompt's demand keeps half of them for prefill, so five
    seats are left for decodes. The new request, which may preempt them, is seated at once:
    LVF rotates out the two it takes, not one a batch while nobody is admitted (it did
    that in the simulator's mixed-SLO run at gh200 artifact settings, for seconds, while
    interactive requests went late with thousands of blocks free: docs/results/rotasched/).
    The iteration-time budget holds these seats, so memory_margin does not apply."""
    clock = [0.0]
    cost = PerToken(1e-5)
    limits = RotationLimits.bare(min_residency=0, prefill_within=0.02, memory_margin=memory_margin)
    sched = Scheduler(SchedulerConfig(num_device_blocks=256, num_host_blocks=256, block_size=4,
                                      max_num_seqs=16, eager_budget_blocks=0),
                      make_policy("lvf", VLTParams(), limits),
                      clock=lambda: clock[0], cost=cost)  # type: ignore[arg-type]
    for i in range(6):
        sched.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1000,
                                                                      ignore_eos=True),
                                  arrival_time=0.0, slo=SLO(5.0, 0.1)))
    for _ in range(5):
        _step(sched, clock)
    assert len(sched.running) == 6 and sched.seat_limit == 16
    cost.per_token = 0.0085  # ten tokens in 90 ms
    new = Request("new", list(range(20)), SamplingParams(max_tokens=4, ignore_eos=True),
                  arrival_time=clock[0], slo=SLO(5.0, 0.1))
    sched.add_request(new)
    clock[0] += 1.0
    out = sched.schedule()
    assert sched.seat_limit == 5 and sched.policy.time_bound
    assert new.state is RequestState.RUNNING and "new" in {c.request_id for c in out.chunks}
    assert len(out.rotated_out) == 2 and len(sched.running) == 5


def test_seats_count_in_everything_fits() -> None:
    sched = _busy("lvf", None, n=3)
    sched.config.max_num_seqs = sched.seat_limit = 2
    assert sched._blocks_needed <= sched.config.num_device_blocks
    assert not sched.everything_fits()


# -- SLO-miss attribution ----------------------------------------------------------------------
def test_a_request_knows_where_its_missed_time_went() -> None:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), arrival_time=0.0,
                slo=SLO(ttft_s=1.0, tbt_s=0.1))
    r.set_state(RequestState.RUNNING, 0.5)  # waited 0.5 s
    r.charge_transfer_stall(0.2)
    r.append_token(1, 1.5)  # TTFT 1.5 s > 1 s: 0.5 waiting, 0.8 computing, 0.2 transfer
    assert r.ttft_phases == pytest.approx(
        {"waiting": 0.5, "rotary": 0.0, "computing": 0.8, "transfer": 0.2})
    r.append_token(1, 1.55)  # a gap within the SLO: not counted
    r.set_state(RequestState.ROTARY, 1.6)
    r.set_state(RequestState.RUNNING, 3.6)
    r.append_token(1, 3.7)  # a 2.15 s gap: 2 s parked, 0.15 s on the device
    assert r.num_missed_gaps == 1
    assert r.missed_gap_phases == pytest.approx(
        {"waiting": 0.0, "rotary": 2.0, "computing": 0.15, "transfer": 0.0})
    summary = r.summary(4.0)
    assert summary["missed_gaps"] == 1 and summary["transfer_stall_s"] == pytest.approx(0.2)
    # Every phase of every interval adds up to the interval.
    assert sum(r.ttft_phases.values()) == pytest.approx(1.5)


def test_miss_histograms_flatten_to_keys_the_gateway_types() -> None:
    from gateway.metrics import HISTOGRAM, SCHEDULER_SERIES

    r = Request("r", [1], SamplingParams(max_tokens=4), 0.0, slo=SLO(1.0, 0.1))
    r.set_state(RequestState.RUNNING, 3.0)
    r.append_token(1, 3.5)
    h = MissHistograms()
    h.observe(r, ttft_missed=True, now=3.5)
    flat = h.as_dict()
    assert {base_key(k) for k in flat} == set(HISTOGRAM_KEYS)
    assert all(SCHEDULER_SERIES[k].kind == HISTOGRAM for k in HISTOGRAM_KEYS)
    assert flat["slo_miss_ttft_waiting_s:sum"] == pytest.approx(3.0)
    assert flat["slo_miss_ttft_waiting_s:bucket:5.0"] == 1.0
    assert flat["slo_miss_ttft_waiting_s:bucket:2.5"] == 0.0
    assert flat["slo_miss_tbt_rotary_s:count"] == 0.0  # no gap missed


# -- goodput, and SLO classes -------------------------------------------------------------------
def _record(ttft: float, gaps: list[float], slo: tuple[float, float] = (1.0, 0.1),
            cls: str | None = None) -> RequestRecord:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord("r", 0.0, times, slo[0], slo[1], slo_class=cls)


def test_goodput_as_vllm_counts_it_and_the_every_gap_variant() -> None:
    recs = [
        _record(0.5, [0.05] * 9),  # good either way
        _record(0.5, [0.05] * 8 + [0.45]),  # one gap over, mean 0.094: vLLM good, every-gap not
        _record(2.0, [0.05] * 9),  # TTFT missed
        _record(0.5, []),  # one token: TPOT 0, good
    ]
    m = compute_metrics(recs, duration_s=10.0)
    assert m.good_requests == 3
    assert m.goodput_rps == pytest.approx(3 / m.makespan_s)  # per second of the run (vLLM)
    assert m.goodput_every_gap_rps == pytest.approx(2 / 10.0)  # per second of arrivals


def test_attainment_per_slo_class() -> None:
    recs = [_record(0.5, [0.04] * 4, (1.0, 0.05), "interactive"),
            _record(1.5, [0.04] * 4, (1.0, 0.05), "interactive"),
            _record(15.0, [0.4] * 4, (20.0, 0.5), "batch")]
    m = compute_metrics(recs, duration_s=10.0)
    assert m.per_class["interactive"]["ttft_attainment"] == 0.5
    assert m.per_class["batch"]["ttft_attainment"] == 1.0
    assert m.per_class["batch"]["requests"] == 1


def _batch_and_interactive(now: float, device_blocks: int, inter_arrival: float
                           ) -> tuple[Scheduler, list[float], Request, Request]:
    """LVF with 8 tokens of budget a batch; a batch-class prompt (20 s / 500 ms SLO) that
    arrived at 0 and an interactive one (1 s / 50 ms), 16 tokens each, not yet added."""
    clock = [now]
    sched = Scheduler(SchedulerConfig(num_device_blocks=device_blocks, num_host_blocks=64,
                                      block_size=4, max_batched_tokens=8,
                                      eager_budget_blocks=0),
                      make_policy("lvf"), clock=lambda: clock[0])
    batch = Request("batch", list(range(16)), SamplingParams(max_tokens=4, ignore_eos=True),
                    arrival_time=0.0, slo=SLO(20.0, 0.5))
    inter = Request("inter", list(range(16)), SamplingParams(max_tokens=4, ignore_eos=True),
                    arrival_time=inter_arrival, slo=SLO(1.0, 0.05))
    return sched, clock, batch, inter


def test_lvf_serves_the_earliest_ttft_deadline_first_while_everything_fits() -> None:
    """Memory and seats to spare (LVF's plain-FCFS step), the token budget binding: an
    interactive prompt (1 s TTFT SLO) that arrived after a batch-class one (20 s) gets the
    budget first, its deadline being earlier; with one SLO class this is arrival order.
    (In arrival order the simulator's mixed-SLO run, gh200 artifact settings at 20 req/s,
    gave batch-class prompts that had waited 2 s the budget while interactive ones went
    late: docs/results/rotasched/.)"""
    sched, clock, batch, inter = _batch_and_interactive(0.6, 64, inter_arrival=0.5)
    sched.add_request(batch)
    sched.add_request(inter)
    assert sched.everything_fits()
    served = []
    for _ in range(2):
        out = sched.schedule()
        served.append({c.request_id: len(c.token_ids) for c in out.chunks})
        sched.update_from_output(out, ExecuteResult(
            {c.request_id: 7 for c in out.chunks if c.sample}, execute_s=0.01))
        clock[0] += 0.01
    assert served == [{"inter": 8}, {"inter": 8}]
    assert inter.first_token_time is not None and batch.num_computed_tokens == 0


def test_lvf_ranks_slo_classes_by_slack_in_seconds_when_memory_is_short() -> None:
    """Memory short (LVF orders by VLT, not plain FCFS), the token budget binding: a batch-
    class prompt (20 s TTFT SLO) that has waited 13 s has used more of its own budget than
    an interactive one (1 s) that has waited 0.4 s, but 7 s more slack. With every lag in
    one unit, the longest live TTFT SLO, the interactive prompt is prefilled first. (In
    each request's own SLO the batch one went first; in the simulator's mixed-SLO run,
    gh200 artifact settings at 20 req/s, two interactive requests then missed their TTFT
    deadline behind batch-class prompts with seconds to spare: docs/results/rotasched/.)"""
    sched, _, batch, inter = _batch_and_interactive(13.0, 8, inter_arrival=12.6)
    sched.add_request(batch)
    assert sched.policy.lag_unit_s is None  # one class: each request's own SLO
    sched.add_request(inter)
    assert sched.policy.lag_unit_s == 20.0
    assert not sched.everything_fits()
    out = sched.schedule()
    assert {c.request_id: len(c.token_ids) for c in out.chunks} == {"inter": 8}
    sched.abort("inter")
    assert sched.policy.lag_unit_s is None


def test_slo_classes_parse_and_each_request_carries_its_own() -> None:
    assert parse_slo_classes("mixed") == SLO_MIXES["mixed"]
    assert parse_slo_classes("a=1:0.05:1,b=20:0.5:3") == (SLOClass("a", 1.0, 0.05, 1.0),
                                                         SLOClass("b", 20.0, 0.5, 3.0))
    assert parse_slo_classes(None) == ()
    for bad, msg in [("a=1:0.05", "expected name=TTFT_S"), ("a=x:1:1", "must be numbers"),
                     ("a=1:0:1", "positive"), ("a=1:1:1,a=2:2:1", "same name")]:
        with pytest.raises(WorkloadError, match=msg):
            parse_slo_classes(bad)
    spec = WorkloadSpec(rps=10, duration_s=20, slo_classes=SLO_MIXES["mixed"])
    trace = build_trace(spec)
    names = [r.slo.name for r in trace if r.slo is not None]
    assert len(names) == len(trace) and 0.35 < names.count("interactive") / len(trace) < 0.65
    # The classes come from their own stream: lengths and arrivals are those of the plain trace.
    plain = build_trace(WorkloadSpec(rps=10, duration_s=20))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in plain] == [
        (r.arrival_s, r.prompt_len, r.output_len) for r in trace]


# -- the α/β directions of DESIGN §4, in the simulator ----------------------------------------------
_RUNS: dict[tuple[str, str], SLOMetrics] = {}  # (policy, config) -> metrics


def _metrics(variant: str) -> SLOMetrics:
    """One simulation per distinct configuration (lvf:beta_f=0 and lvf:beta_b=0 are LVF's
    defaults both: one run)."""
    v = PolicyVariant.parse(variant)
    cfg = v.apply(SimConfig())
    key = (v.policy, repr(cfg))
    if key not in _RUNS:
        hw = load_hardware("gh200-96gb")
        # 60 s at 24 req/s: since decodes keep their token beside prompt chunks and parked
        # requests count a share of their catch-up, 30 s at 26 req/s no longer builds the
        # backlog that makes LVF trade one SLO for the other (every variant met both
        # there), and the directions need that trade to show.
        trace = build_trace(WorkloadSpec(rps=24, duration_s=60, seed=0))
        _RUNS[key] = Simulator(hw, QWEN, v.policy, cfg, v.label).run(trace, 60).metrics
    return _RUNS[key]


def _sim(variant: str) -> dict[str, float]:
    m = _metrics(variant)
    return {"ttft": m.ttft_attainment, "tbt": m.tbt_attainment, "tpot": m.tpot_attainment,
            "tbt_rotated": m.tbt_attainment_rotated, "tpot_rotated": m.tpot_attainment_rotated,
            "rotations": m.rotations}


def test_raising_alpha_lowers_ttft_and_raises_per_request_tbt_attainment() -> None:
    """α weighs a started request's lag against a new one's (vlt.py). Measured (gh200-96gb,
    24 req/s, 60 s, seed 0, memory margin 6): TTFT 100 / 58.4 / 56.7 % and TPOT 83.0 / 100 /
    100 % at α 0.1, 3, 30 (TPOT is full from α 3 on; before the memory margin: TTFT
    100 / 99.3 / 79.4, TPOT 90.7 / 100 / 100). Per-gap TBT attainment hardly moves with α
    (99.8 / 100 / 100 %): each rotation costs its request one gap however long it is parked, and
    α changes how long more than how often. So the direction holds for the per-request TBT
    (TPOT), not per gap."""
    lo, mid, hi = (_sim(f"lvf:alpha={a}") for a in (0.1, 3, 30))
    assert lo["ttft"] > mid["ttft"] > hi["ttft"]
    assert lo["tpot"] < mid["tpot"] <= hi["tpot"]
    assert abs(hi["tbt"] - lo["tbt"]) < 0.01


def test_raising_beta_f_lowers_ttft_attainment_of_new_requests() -> None:
    """β_F: the share of its TPOT budget a started request may use before it lags. Measured:
    TTFT 86.4 / 79.8 / 75.1 % at β_F 0, 0.5, 1 (memory margin 6; 100 / 92.2 / 86.2 before it)."""
    ttft = [_sim(f"lvf:beta_f={b}")["ttft"] for b in (0.0, 0.5, 1.0)]
    assert ttft[0] > ttft[1] > ttft[2]


def test_raising_beta_b_lowers_tbt_attainment_of_rotary_requests() -> None:
    """β_B: a new request lags after (1 − β_B) of its TTFT budget, so it outranks parked ones
    sooner. Measured: TPOT attainment of the rotated requests 96.0 / 80.6 / 75.9 % at β_B 0,
    0.5, 1. Their per-gap TBT attainment does not fall (99.9 / 99.8 / 99.8 %): waiting
    longer adds no missed gap to a parked request. Rotations are not a direction DESIGN §4
    asks for: they fell with β_B until the memory margin (5845 / 4746 / 4997
    before it), and now rise (291 / 306 / 323): a new request that lags sooner clears the
    margin over more running ones."""
    runs = [_sim(f"lvf:beta_b={b}") for b in (0.0, 0.5, 1.0)]
    assert runs[0]["tpot_rotated"] > runs[1]["tpot_rotated"] > runs[2]["tpot_rotated"]
    assert not math.isnan(runs[0]["tbt_rotated"])


def test_the_simulator_reports_where_missed_time_went() -> None:
    m = _metrics("swapped-first")
    assert m.ttft_missed > 0 and set(m.miss_ttft_s) == set(PHASES)
    # Swapped-first's missed TTFTs are spent queued: it admits nobody past a rotary request.
    assert m.miss_ttft_s["waiting"] > 0.9 * sum(m.miss_ttft_s.values())
    lvf = _metrics("lvf")
    # LVF's missed gaps are its rotations: parked in host memory most of the missed time.
    assert lvf.tbt_missed > 0 and lvf.miss_tbt_s["rotary"] > 0.5 * sum(lvf.miss_tbt_s.values())


def test_update_from_output_feeds_the_online_fit() -> None:
    fit = OnlineIterationCost(min_batches=1)
    sched = Scheduler(SchedulerConfig(num_device_blocks=64, block_size=4), make_policy("lvf"),
                      clock=lambda: 0.0, cost=fit)
    sched.add_request(Request("a", [1] * 8, SamplingParams(max_tokens=4), 0.0))
    out = sched.schedule()
    sched.update_from_output(out, ExecuteResult({"a": 1}, execute_s=0.02))
    assert fit.n == 1 and fit.ready


def test_the_gateway_exports_the_miss_histograms_as_prometheus_histograms() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.metrics import scheduler_families

    r = Request("r", [1], SamplingParams(max_tokens=4), 0.0, slo=SLO(1.0, 0.1))
    r.set_state(RequestState.RUNNING, 3.0)
    r.append_token(1, 3.5)
    h = MissHistograms()
    h.observe(r, ttft_missed=True, now=3.5)

    class Stats:
        def collect(self):  # type: ignore[no-untyped-def]
            return list(scheduler_families(h.as_dict()))

    reg = CollectorRegistry()
    reg.register(Stats())  # type: ignore[arg-type]
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    fam = fams["superinfer_slo_miss_phase_seconds"]
    assert fam.type == "histogram"
    got = {(s.name, s.labels.get("slo"), s.labels.get("phase"), s.labels.get("le")): s.value
           for s in fam.samples}
    assert got[("superinfer_slo_miss_phase_seconds_sum", "ttft", "waiting", None)] == 3.0
    assert got[("superinfer_slo_miss_phase_seconds_count", "ttft", "waiting", None)] == 1.0
    assert got[("superinfer_slo_miss_phase_seconds_bucket", "ttft", "waiting", "2.5")] == 0.0
    assert got[("superinfer_slo_miss_phase_seconds_bucket", "ttft", "waiting", "+Inf")] == 1.0
