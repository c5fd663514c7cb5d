"""Policy decisions on hand-built requests: no model, no engine loop."""

from __future__ import annotations

import pytest

from scheduler_svc.policy import RotationLimits, Unservable, VLTParams, make_policy, vlt
from scheduler_svc.policy.lvf import LVFPolicy
from scheduler_svc.policy.vlt import deadline, due_time, is_late
from scheduler_svc.request import SLO, Request, RequestState, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def req(rid: str, arrival: float, state: RequestState = RequestState.WAITING,
        last_token: float | None = None, run_start: float | None = None,
        slo: SLO | None = None, prompt: int = 8, max_tokens: int = 100,
        eos: bool = False) -> Request:
    """`eos`: it may end by EOS before max_tokens (its length is not known)."""
    r = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), arrival,
                slo=slo or SLO(5.0, 0.1), eos_token_ids=(2,) if eos else ())
    r.state = state
    if last_token is not None:
        r.first_token_time = r.last_token_time = last_token
        r.output_token_ids = [1]
    r.run_start_time = run_start
    return r


P = VLTParams(alpha=3.0, beta_b=0.0, beta_f=0.5)
# Output-length snapshots (LVFPolicy.lengths) for requests whose length is not known: none
# finished yet, and a spread of lengths with ties.
LENGTHS_SEEN = [(), (3, 20, 20, 64, 150, 150, 300, 900)]
# The inlined arithmetic (merge_key, running_order) is checked against the definitions for
# each: the defaults, β's, and the stall bound with β_F at 0 and not.
PARAMS_VARIANTS = [P, VLTParams(), VLTParams(alpha=0.7, beta_b=0.3, beta_f=0.2),
                   VLTParams(max_stall=0.25), VLTParams(alpha=3.0, beta_f=0.5, max_stall=0.1)]


def test_vlt_formulas() -> None:
    now = 10.0
    w = req("w", arrival=5.0)
    assert vlt(w, now, P) == pytest.approx(5.0 / 5.0 - 1.0)
    # A started request lags against its pace: with k tokens out its next one is due at
    # first + k·S_F; one token at 9.9 -> due at 10.0, and 3·(0 + 0.5·0.1)/5 at 10.0.
    r = req("r", 0.0, RequestState.ROTARY, last_token=9.9)
    assert due_time(r) == pytest.approx(10.0)
    assert vlt(r, now, P) == pytest.approx(3.0 * (0.0 + 0.5 * 0.1) / 5.0)
    # ... crossing 0 (1 - beta_f) of a gap after its last token, as on pace it always did.
    assert vlt(r, 9.95, P) == pytest.approx(0.0, abs=1e-12)
    # Banked time counts: 11 tokens in 0.5 s (iterations of 50 ms) -> due at 9.9 + 1.1 - 0.1.
    fast = req("f", 0.0, RequestState.ROTARY, last_token=9.4)
    fast.first_token_time, fast.output_token_ids = 8.9, [1] * 11
    assert due_time(fast) == pytest.approx(8.9 + 11 * 0.1)
    assert not is_late(fast, now) and is_late(r, 10.01)
    # A running request lags against the same deadline: it leads by what it banked.
    run = req("x", 0.0, RequestState.RUNNING, last_token=9.4, run_start=9.0)
    run.first_token_time, run.output_token_ids = 8.9, [1] * 11  # due 10.0, anchor 9.45
    assert vlt(run, 9.0, P) == pytest.approx((9.0 - 9.45) / 5.0 / 3.0)
    # Served at 20 ms per token, its 89 tokens to go win back 89 × 0.08 − 0.1 s: its
    # deadline moves that far, and its VLT with it. At 60 ms a second of lag costs 1.5 s
    # of a seat: 1/1.5 of the 89 × 0.04 − 0.1 s counts. At S_F or slower, nothing.
    assert deadline(run, 0.02) == pytest.approx(10.0 + 89 * 0.08 - 0.1)
    assert vlt(run, 9.0, P, 0.02) == pytest.approx((9.0 - (17.02 - 0.55)) / 5.0 / 3.0)
    assert deadline(run, 0.06) == pytest.approx(10.0 + (89 * 0.04 - 0.1) / 1.5)
    assert deadline(run, 0.1) == deadline(run) == pytest.approx(10.0)
    # One still prefilling its prompt leads by how long it has run.
    pre = req("y", 0.0, RequestState.RUNNING, run_start=9.0)
    assert vlt(pre, now, P) == pytest.approx(-1.0 / (3.0 * 0.1))


def test_lvf_serves_on_time_requests_by_vlt_then_late_ones_oldest_first() -> None:
    now = 10.0
    fresh = req("fresh", arrival=9.9)  # VLT ≈ -0.98
    old = req("old", arrival=6.0)  # -0.2, on time (TTFT deadline 11.0)
    missed = req("missed", arrival=3.0)  # TTFT deadline 8.0 passed: late
    rot = req("rot", 0.0, RequestState.ROTARY, last_token=9.97)  # due 10.07: 3·0.12/5 ≈ 0.07
    parked = req("parked", 0.0, RequestState.ROTARY, last_token=9.5)  # due 9.6: late
    lvf = make_policy("lvf", P, RotationLimits.bare())
    order = lvf.candidates([fresh, old, missed], [rot, parked], now)
    # On time by VLT (rot, old, fresh), then late by deadline (missed 8.0, parked 9.6).
    assert [r.request_id for r in order] == ["rot", "old", "fresh", "missed", "parked"]
    # A late request never preempts anyone: it is served from free capacity.
    victim = req("v", 0.0, RequestState.RUNNING, run_start=1.0)  # prefilling for 9 s
    assert lvf.may_preempt(victim, fresh, now) and lvf.may_preempt(victim, rot, now)
    assert not lvf.may_preempt(victim, missed, now) and not lvf.may_preempt(victim, parked, now)


def test_a_parked_request_behind_its_pace_is_late_only_when_it_cannot_catch_up() -> None:
    """Behind its pace by 2 s with 90 of its 100 tokens to go (S_F 100 ms): at 20 ms per
    token it catches up (it may be 90 × 0.08 − 0.1 = 7.1 s behind). At 60 ms it could win
    back 3.5 s, of which 1/1.5 counts (a second of lag costs 1.5 s of a seat): 2.33 s, on
    time. At 90 ms, 0.8 s of which 1/9 counts: late."""
    now = 10.0
    parked = req("p", 0.0, RequestState.ROTARY, last_token=7.0)
    parked.output_token_ids = [1] * 10  # first token at 7.0: due at 8.0, behind by 2 s
    fresh = req("fresh", arrival=9.9)
    victim = req("v", 0.0, RequestState.RUNNING, run_start=1.0)  # prefilling for 9 s
    assert is_late(parked, now) and is_late(parked, now, gap_s=0.09)
    assert not is_late(parked, now, gap_s=0.02) and not is_late(parked, now, gap_s=0.06)
    lvf = make_policy("lvf", P, RotationLimits.bare())
    assert [r.request_id for r in lvf.candidates([fresh], [parked], now)] == ["fresh", "p"]
    assert not lvf.may_preempt(victim, parked, now)
    for _ in range(50):  # batches of 20 ms: now it lags most, and may preempt
        lvf.observe_iteration(0.02)
    assert lvf.gap_s == pytest.approx(0.02)
    assert [r.request_id for r in lvf.candidates([fresh], [parked], now)] == ["p", "fresh"]
    assert lvf.may_preempt(victim, parked, now)


def test_a_request_of_unknown_length_is_parked_on_less_and_given_up_on_later() -> None:
    """The catch-up allowance counts the tokens a request will still produce. With
    ignore_eos (a benchmark's requests) that is max_tokens - k. A request that may end by
    EOS is ordered by what nine in ten finished requests longer than it went on to
    produce, at most max_tokens - k, and is late only when not even max_tokens - k would
    bring it back: an OpenAI request without max_tokens carries the whole context as its
    bound, and counting on that for its order parked it for catch-ups it never had the
    tokens for."""
    from scheduler_svc.policy.vlt import tokens_left

    known = Request("k", [0] * 8, SamplingParams(max_tokens=8000, ignore_eos=True), 0.0,
                    slo=SLO(5.0, 0.1), eos_token_ids=(2,))
    loose = req("u", 0.0, max_tokens=8000, eos=True)
    tight = req("t", 0.0, max_tokens=40, eos=True)
    assert known.length_known and not loose.length_known
    assert req("plain", 0.0).length_known  # no EOS it could stop at: max_tokens ends it
    assert not Request("s", [0], SamplingParams(max_tokens=9, ignore_eos=True,
                                                stop_token_ids=(5,)), 0.0).length_known
    lengths = (3, 20, 20, 64, 150, 150, 300, 900)
    assert tokens_left(known, 10, lengths) == tokens_left(loose, 10) == 7990
    # Longer than 10: 20, 20, 64, 150, 150, 300, 900; a tenth of them under 20: 10 to go.
    assert tokens_left(loose, 10, lengths) == 10
    assert tokens_left(loose, 150, lengths) == 150  # of 300 and 900, the shorter
    assert tokens_left(loose, 900, lengths) == 0  # none finished longer: nothing
    assert tokens_left(loose, 10, ()) == 0  # none finished yet
    assert tokens_left(tight, 5, lengths) == 15 and tokens_left(tight, 30, lengths) == 10
    # Behind its pace by 2 s (its 10th token was due at 8.0; S_F 100 ms), served at 20 ms
    # a token: the known one may be 7990 × 0.08 − 0.1 s behind. The loose one lags in the
    # order (it counts on 10 tokens: 0.7 s) and is not late (8000 would bring it back);
    # the tight one's bound brings back 30 × 0.08 − 0.1 = 2.3 s: late after 10.3.
    for r in (known, loose, tight):
        r.state, r.first_token_time = RequestState.ROTARY, 7.0
        r.last_token_time, r.output_token_ids = 7.0, [1] * 10
    assert deadline(loose, 0.02, lengths) == pytest.approx(8.0 + 10 * 0.08 - 0.1)
    assert deadline(loose, 0.02) == deadline(known, 0.02, lengths)
    lvf = make_policy("lvf", VLTParams())
    lvf.gap_s, lvf.lengths = 0.02, lengths
    assert vlt(loose, 10.0, VLTParams(), 0.02, None, lengths) > 0.0 > vlt(known, 10.0, VLTParams(), 0.02)
    # Not late, but by what it counts on it can wait no longer: it triggers no rotation.
    assert not lvf.is_late(loose, 10.0) and lvf.slack_s(loose, 10.0) is None
    assert lvf.slack_s(loose, 8.6) == pytest.approx(0.1)
    assert not lvf.is_late(tight, 10.2) and lvf.is_late(tight, 10.4)
    assert lvf.slack_s(tight, 10.4) is None
    # The admission order agrees: the loose one is on time and lags, the tight one late.
    assert lvf.merge_key(loose, 10.2)[0] == 0.0 and lvf.merge_key(loose, 10.2)[1] < 0.0
    assert lvf.merge_key(tight, 10.4)[0] == 1.0


def test_lvf_learns_output_lengths_from_finished_requests() -> None:
    """LVF keeps the output lengths of requests that finished (not aborted ones), and takes
    a new sorted snapshot for its deadlines only together with a re-filing of its queues:
    after LENGTHS_STEP finishes, observe_iteration says the order keys changed."""
    from scheduler_svc.policy.vlt import OutputLengths
    from scheduler_svc.request import FinishReason

    lvf = make_policy("lvf", VLTParams())
    assert isinstance(lvf, LVFPolicy)
    assert lvf.observe_iteration(0.05)  # the first batch time
    step = lvf.LENGTHS_STEP
    for i in range(step):
        r = req(f"f{i}", 0.0)
        r.output_token_ids = [1] * (step - i)
        r.finish_reason = FinishReason.STOP if i else FinishReason.ABORT
        lvf.observe_finish(r)
    assert not lvf.observe_iteration(0.05) and lvf.lengths == ()  # one was an abort
    r.finish_reason = FinishReason.LENGTH
    lvf.observe_finish(r)
    assert lvf.observe_iteration(0.05)
    assert lvf.lengths == tuple(sorted([*range(1, step), 1]))
    window = OutputLengths(window=3)
    for n in (5, 1, 9, 4):
        window.observe(n)
    assert window.view() == (1, 4, 9) and window.added == 4  # the oldest (5) left


def test_a_new_request_is_late_once_its_first_token_would_miss_its_ttft() -> None:
    """Admitted now, a first token comes up to two batches later (the batch in flight, then
    its own): a new request with less TTFT budget than that left is late, not the most
    urgent on-time one (in the simulator the rule 'late only past the TTFT deadline' kept
    admitting requests whose first tokens then just missed: Llama-3-8B at 140 req/s)."""
    now = 10.0
    edge = req("edge", arrival=5.3)  # TTFT deadline 10.3: 0.3 s of budget left
    fresh = req("fresh", arrival=9.9)
    victim = req("v", 0.0, RequestState.RUNNING, run_start=1.0)
    lvf = make_policy("lvf", P, RotationLimits.bare())
    assert not is_late(edge, now) and not is_late(edge, now, gap_s=0.1)
    assert [r.request_id for r in lvf.candidates([fresh, edge], [], now)] == ["edge", "fresh"]
    assert lvf.may_preempt(victim, edge, now)
    for _ in range(50):  # batches of 200 ms: two of them end after 10.3
        lvf.observe_iteration(0.2)
    assert deadline(edge, lvf.gap_s) == pytest.approx(10.3 - 0.4)
    assert is_late(edge, now, lvf.gap_s) and not is_late(fresh, now, lvf.gap_s)
    assert [r.request_id for r in lvf.candidates([fresh, edge], [], now)] == ["fresh", "edge"]
    assert not lvf.may_preempt(victim, edge, now)


def test_lvf_honours_per_request_slos() -> None:
    now = 10.0
    loose = req("loose", arrival=8.0, slo=SLO(ttft_s=10.0, tbt_s=0.1))  # 0.2 - 1 = -0.8
    tight = req("tight", arrival=9.5, slo=SLO(ttft_s=1.0, tbt_s=0.1))  # 0.5 - 1 = -0.5
    order = make_policy("lvf", P, RotationLimits.bare()).candidates([loose, tight], [], now)
    assert order[0] is tight
    # A rotary request with a tight TBT SLO is due sooner than one with a loose one.
    a = req("a", 0.0, RequestState.ROTARY, last_token=9.95, slo=SLO(5.0, 0.1))
    b = req("b", 0.0, RequestState.ROTARY, last_token=9.95, slo=SLO(5.0, 1.0))
    assert make_policy("lvf", P, RotationLimits.bare()).candidates([], [b, a], now)[0] is a


def test_lvf_never_preempts_a_request_with_nonnegative_vlt() -> None:
    now = 10.0
    lvf = make_policy("lvf", P, RotationLimits.bare())
    lagging = req("s", arrival=6.0)  # -0.2: on time
    behind = req("j", 0.0, RequestState.RUNNING, last_token=9.9, run_start=now)  # due 10.0
    assert vlt(behind, now, P) > 0.0  # its lag starts at 9.95 (beta_f)
    assert not lvf.may_preempt(behind, lagging, now)
    long_runner = req("l", 0.0, RequestState.RUNNING, run_start=2.0)  # prefilling for 8 s
    assert lvf.may_preempt(long_runner, lagging, now)
    # ... and only for a candidate that lags more than the victim leads: 60 tokens since
    # 8.0 put this one's anchor at 11.0 (VLT -0.067), ahead of "lagging" (-0.2), behind a
    # rotary request past its anchor.
    ahead = req("a", 0.0, RequestState.RUNNING, last_token=9.95, run_start=2.0)
    ahead.first_token_time, ahead.output_token_ids = 8.0, [1] * 60
    rot = req("rot", 0.0, RequestState.ROTARY, last_token=9.97)
    assert not lvf.may_preempt(ahead, lagging, now) and lvf.may_preempt(ahead, rot, now)
    fresh = req("f", arrival=10.0)
    assert not lvf.may_preempt(req("v", 0.0, RequestState.RUNNING, run_start=9.99), fresh, now)


def test_baseline_orders() -> None:
    now = 10.0
    w1, w2 = req("w1", 1.0), req("w2", 2.0)
    r1 = req("r1", 0.5, RequestState.ROTARY, last_token=9.0)
    sf = make_policy("swapped-first")
    wf = make_policy("waiting-first")
    fc = make_policy("fcfs")
    assert [r.request_id for r in sf.candidates([w2, w1], [r1], now)] == ["r1", "w1", "w2"]
    assert [r.request_id for r in wf.candidates([w2, w1], [r1], now)] == ["w1", "w2", "r1"]
    assert [r.request_id for r in fc.candidates([w2, w1], [], now)] == ["w1", "w2"]
    assert not fc.uses_host_pool and sf.uses_host_pool and wf.uses_host_pool
    victim = req("v", 0.0, RequestState.RUNNING, last_token=9.9, run_start=1.0)
    assert wf.may_preempt(victim, w1, now)  # preempt to admit new requests
    assert not wf.may_preempt(victim, r1, now)  # ... but not to swap in
    assert not sf.may_preempt(victim, r1, now)
    assert not fc.may_preempt(victim, w1, now)


def test_admission_decisions_are_the_policys() -> None:
    """Each decision point of admission, asked of each policy on hand-built requests."""
    now = 10.0
    lvf = make_policy("lvf", P, RotationLimits.bare(hold_vlt=-0.5))
    sf, wf, fc = make_policy("swapped-first"), make_policy("waiting-first"), make_policy("fcfs")
    rotary = req("r", 0.0, RequestState.ROTARY, last_token=9.9)
    # Step 1 of LVF: plain FCFS only while everything fits; the baselines never switch.
    assert lvf.plain_fcfs(True) and not lvf.plain_fcfs(False)
    assert not any(p.plain_fcfs(True) for p in (sf, wf, fc))
    # vLLM 0.6's rule: no swap-in in an iteration that preempted.
    assert not sf.may_swap_in(rotary, True) and sf.may_swap_in(rotary, False)
    assert lvf.may_swap_in(rotary, True) and wf.may_swap_in(rotary, True)
    # Unservable candidates: LVF skips, unless a new request lags past hold_vlt.
    young, old = req("y", arrival=9.9), req("o", arrival=7.0)  # VLT -0.98 and -0.4
    assert lvf.on_unservable(young, now) is Unservable.SKIP
    assert lvf.on_unservable(old, now) is Unservable.STOP
    assert lvf.on_unservable(rotary, now) is Unservable.SKIP
    assert all(p.on_unservable(young, now) is Unservable.STOP for p in (sf, wf, fc))
    # Preemption parks KV in host memory, except under fcfs (recompute).
    victim = req("v", 0.0, RequestState.RUNNING, last_token=9.9, run_start=1.0)
    assert lvf.swaps_out(victim) and sf.swaps_out(victim) and not fc.swaps_out(victim)


def _filled(policy: str, limits: RotationLimits | None = None) -> tuple[Scheduler, list[float]]:
    """4 running requests fill the device pool; a 5th waits. Returns scheduler and clock.
    The running ones have a loose TBT SLO (10 s): their first token puts them far ahead
    of their pace, so they lead a new request by more than its TTFT budget."""
    t = [0.0]
    s = Scheduler(
        SchedulerConfig(num_device_blocks=8, num_host_blocks=64, block_size=4,
                        max_batched_tokens=64, eager_budget_blocks=0),
        make_policy(policy, P, limits or RotationLimits.bare()), clock=lambda: t[0],
    )
    for i in range(4):
        s.add_request(Request(f"r{i}", list(range(7)), SamplingParams(max_tokens=50), 0.0,
                              slo=SLO(1.0, 10.0)))
    out = s.schedule()
    assert len(out.chunks) == 4 and s.bm.num_free_device == 0
    s.update_from_output(out, _sampled(out))
    s.add_request(Request("new", list(range(7)), SamplingParams(max_tokens=50), 0.0,
                          slo=SLO(1.0, 0.1)))
    return s, t


def _sampled(out):  # type: ignore[no-untyped-def]
    from common.contracts import ExecuteResult

    return ExecuteResult({c.request_id: 5 for c in out.chunks if c.sample})


def test_lvf_rotates_out_to_serve_a_lagging_request() -> None:
    s, t = _filled("lvf")
    t[0] = 0.6  # "new" has spent 60 % of its 1 s TTFT SLO (VLT -0.4); the others ran 0.6 s
    out = s.schedule()
    assert "new" in [c.request_id for c in out.chunks]
    assert len(out.rotated_out) >= 1 and s.stats.rotations >= 1
    assert out.transfers is not None and out.transfers.swap_out
    s.check_integrity()


def test_lvf_does_not_rotate_anyone_out_for_a_request_that_already_missed() -> None:
    s, t = _filled("lvf")
    t[0] = 2.0  # "new" waited past its 1 s TTFT SLO: late, it waits for free blocks
    out = s.schedule()
    assert "new" not in [c.request_id for c in out.chunks]
    assert s.stats.preemptions == 0


def test_lvf_degenerates_to_fcfs_when_everything_fits() -> None:
    t = [0.0]
    s = Scheduler(SchedulerConfig(num_device_blocks=100, num_host_blocks=64, block_size=4),
                  make_policy("lvf", P, RotationLimits.bare()), clock=lambda: t[0])
    for i in range(5):
        s.add_request(Request(f"r{i}", list(range(7)), SamplingParams(max_tokens=5), float(i)))
    t[0] = 100.0  # everyone lags enormously, but everything fits: no rotation
    for _ in range(10):
        out = s.schedule()
        assert out.transfers is None or not (out.transfers.swap_out or out.transfers.swap_in)
        s.update_from_output(out, _sampled(out))
    assert s.stats.rotations == 0 and s.stats.preemptions == 0


@pytest.mark.parametrize("policy", ["fcfs", "swapped-first"])
def test_baselines_do_not_preempt_proactively(policy: str) -> None:
    s, t = _filled(policy)
    t[0] = 2.0
    out = s.schedule()
    assert "new" not in [c.request_id for c in out.chunks]
    assert s.stats.preemptions == 0


def test_waiting_first_preempts_last_admitted_for_a_new_request() -> None:
    s, t = _filled("waiting-first")
    t[0] = 0.1
    out = s.schedule()
    assert "new" in [c.request_id for c in out.chunks]
    assert out.rotated_out == ["r3"]  # the last admitted goes first


def test_min_residency_protects_a_swapped_in_request() -> None:
    s, t = _filled("lvf", RotationLimits.bare(min_residency=1000))
    t[0] = 2.0
    out = s.schedule()
    # All four were admitted in iteration 1 and are inside their residency: nobody moves.
    assert "new" not in [c.request_id for c in out.chunks]
    assert s.stats.preemptions == 0


def test_lvf_skips_an_unservable_head_and_serves_the_next() -> None:
    t = [0.0]
    s = Scheduler(
        SchedulerConfig(num_device_blocks=6, num_host_blocks=64, block_size=4,
                        max_batched_tokens=64, eager_budget_blocks=0),
        make_policy("lvf", P, RotationLimits.bare(min_residency=1000)), clock=lambda: t[0],
    )
    s.add_request(Request("small-running", list(range(7)), SamplingParams(max_tokens=50), 0.0))
    s.update_from_output(out := s.schedule(), _sampled(out))
    s.add_request(Request("big", list(range(19)), SamplingParams(max_tokens=5), 0.0))  # 5 blocks
    s.add_request(Request("small", list(range(7)), SamplingParams(max_tokens=5), 0.5))  # 2 blocks
    t[0] = 10.0  # both lag; "big" lags most but cannot fit while "small-running" is resident
    out = s.schedule()
    ids = [c.request_id for c in out.chunks]
    assert "big" not in ids and "small" in ids
    fcfs = Scheduler(
        SchedulerConfig(num_device_blocks=6, num_host_blocks=64, block_size=4,
                        max_batched_tokens=64, eager_budget_blocks=0),
        make_policy("swapped-first"), clock=lambda: t[0],
    )
    t[0] = 0.0
    fcfs.add_request(Request("small-running", list(range(7)), SamplingParams(max_tokens=50), 0.0))
    fcfs.update_from_output(out := fcfs.schedule(), _sampled(out))
    fcfs.add_request(Request("big", list(range(19)), SamplingParams(max_tokens=5), 0.0))
    fcfs.add_request(Request("small", list(range(7)), SamplingParams(max_tokens=5), 0.5))
    out = fcfs.schedule()
    assert [c.request_id for c in out.chunks] == ["small-running"]  # strict order: HOL blocked


def test_lvf_stops_skipping_a_new_request_that_lags_past_hold_vlt() -> None:
    """Anti-starvation: a big new request may be skipped for smaller later ones only until
    its VLT reaches hold_vlt; from then on admission stops at it, so free blocks gather
    for it (on the real stack, skipping alone let a 24-block prompt wait 21 s)."""

    def admitted_at(now: float) -> list[str]:
        t = [0.0]
        s = Scheduler(
            SchedulerConfig(num_device_blocks=6, num_host_blocks=64, block_size=4,
                            max_batched_tokens=64, eager_budget_blocks=0),
            make_policy("lvf", P, RotationLimits.bare(min_residency=1000, hold_vlt=-0.5)),
            clock=lambda: t[0],
        )
        s.add_request(Request("small-running", list(range(7)), SamplingParams(max_tokens=50),
                              0.0))
        s.update_from_output(out := s.schedule(), _sampled(out))
        s.add_request(Request("big", list(range(19)), SamplingParams(max_tokens=5), 0.0))
        s.add_request(Request("small", list(range(7)), SamplingParams(max_tokens=5), 0.5))
        t[0] = now
        return [c.request_id for c in s.schedule().chunks]

    # TTFT SLO 5 s: at 1 s big's VLT is -0.8 (skipped); at 3 s it is -0.4 (holds the line).
    assert "small" in admitted_at(1.0) and "big" not in admitted_at(1.0)
    assert admitted_at(3.0) == ["small-running"]


@pytest.mark.parametrize("memory_margin", [0.0, 1.0, 6.0])
def test_lvf_rotates_out_to_free_a_seat(memory_margin: float) -> None:
    """Seats bind before memory (max_num_seqs 2, a pool of 100 blocks): LVF leaves plain FCFS
    all the same and rotates a running request out for a lagging new one (with
    the engine's 256 seats LVF used to stay inert whenever memory was not short). The seat
    is held by max_num_seqs, not by the iteration-time budget: with memory_margin the new
    request must lag the victim by that much more (here it lags by 1 lag unit: 1 is not
    more, so it waits)."""
    t = [0.0]
    s = Scheduler(
        SchedulerConfig(num_device_blocks=100, num_host_blocks=64, block_size=4,
                        max_batched_tokens=64, max_num_seqs=2, eager_budget_blocks=0),
        make_policy("lvf", P, RotationLimits.bare(memory_margin=memory_margin)),
        clock=lambda: t[0],
    )
    for rid, tbt in (("r0", 10.0), ("r1", 10.0), ("new", 0.1)):
        s.add_request(Request(rid, list(range(7)), SamplingParams(max_tokens=500), 0.0,
                              slo=SLO(1.0, tbt)))
    s.update_from_output(out := s.schedule(), _sampled(out))
    assert len(s.running) == 2 and s.everything_fits() is False  # memory fits, seats do not
    t[0] = 0.5  # "new" on time (VLT -0.5); the running ones, with a loose TBT SLO of 10 s,
    # ahead of their pace (anchor 5.0: VLT -1.5)
    out = s.schedule()
    assert not s.policy.time_bound and len(s.running) == 2
    if memory_margin >= 1.0:
        assert out.rotated_out == [] and "new" not in [c.request_id for c in out.chunks]
        return
    assert "new" in [c.request_id for c in out.chunks]
    assert out.rotated_out == ["r1"]


@pytest.mark.parametrize(("name", "params"), [("lvf", P), ("lvf", VLTParams()), ("fcfs", P),
                                              ("swapped-first", P), ("waiting-first", P),
                                              ("lvf", VLTParams(max_stall=0.25)),
                                              ("lvf", VLTParams(beta_f=0.5, max_stall=0.1))])
def test_lazy_merged_order_equals_the_plain_sort(name: str, params: VLTParams) -> None:
    """The scheduler keeps each policy group sorted and merges them lazily; the result must
    be the order `candidates()` / `running_order()` define, for any mix of SLO classes,
    however requests entered and left the queues."""
    import random

    from scheduler_svc.policy.merge import merge as _merge
    from scheduler_svc.queue import RequestQueue

    rng = random.Random(7)
    policy = make_policy(name, params)
    for trial in range(30):
        now = 100.0
        if trial % 2:  # LVF: some started requests behind their pace can catch up
            policy.observe_iteration(rng.choice([0.01, 0.05, 0.2]))
        # Lags in each request's own TTFT SLO, or in one unit for every class (LVF)
        policy.set_lag_unit(rng.choice([None, 20.0]))
        waiting = RequestQueue(lambda r: policy.order_key(r, False))
        rotary = RequestQueue(lambda r: policy.order_key(r, True))
        running = RequestQueue(policy.running_key)
        members: list[tuple[RequestQueue, Request]] = []
        for i in range(rng.randint(0, 60)):
            slo = SLO(rng.choice([1.0, 5.0, 20.0]), rng.choice([0.05, 0.1, 0.5]))
            arrival = round(rng.uniform(0, now), 1)  # coarse: ties happen
            kind = rng.choice(["new", "recompute", "rotary", "running"])
            last = round(rng.uniform(arrival, now), 1) if kind != "new" else None
            state = {"rotary": RequestState.ROTARY,
                     "running": RequestState.RUNNING}.get(kind, RequestState.WAITING)
            r = req(f"t{trial}-{i}", arrival, state, last_token=last, slo=slo,
                    run_start=round(rng.uniform(arrival, now), 1) if kind == "running" else None)
            r.admitted_iteration = rng.randint(0, 50)
            if last is not None and rng.random() < 0.5:  # deadlines not in last-token order
                r.first_token_time = round(rng.uniform(arrival, last), 1)
                r.output_token_ids = [1] * rng.randint(1, 80)
                r.sampling = SamplingParams(max_tokens=rng.choice([100, 400, 4000]))
            q = {"rotary": rotary, "running": running}.get(kind, waiting)
            q.append(r)
            members.append((q, r))
        for q, r in rng.sample(members, len(members) // 3):  # leave in any order
            q.remove(r)

        def ids(reqs: object) -> list[str]:
            return [r.request_id for r in reqs]  # type: ignore[attr-defined]

        runs = policy.candidate_runs(waiting.groups() + rotary.groups(), now)
        lazy = ids(_merge(runs, policy.merge_key, now))
        plain = ids(policy.candidates(waiting.list(), rotary.list(), now))
        assert lazy == plain
        if policy.static_running_order:  # else the scheduler sorts them (running_order)
            lazy_run = ids(_merge(running.groups(), policy.running_merge_key, now))
            assert lazy_run == ids(policy.running_order(running.list(), now))


def test_queue_tracks_its_smallest_request() -> None:
    from scheduler_svc.queue import RequestQueue

    q = RequestQueue()
    assert q.min_tokens() is None
    rs = [req(f"m{i}", 0.0, prompt=n) for i, n in enumerate([30, 10, 20, 10])]
    for r in rs:
        q.append(r)
    assert q.min_tokens() == 10
    q.remove(rs[1])
    assert q.min_tokens() == 10
    q.remove(rs[3])
    assert q.min_tokens() == 20
    for r in (rs[0], rs[2]):
        q.remove(r)
    assert q.min_tokens() is None


@pytest.mark.parametrize("params", PARAMS_VARIANTS)
def test_lvf_merge_key_is_the_vlt_definitions(params: VLTParams) -> None:
    """LVF's merge key computes is_late, lag_anchor and vlt in one pass (the admission walk
    asks it of hundreds of candidates per iteration), and slack_s deadline's: bit for bit
    the definitions'."""
    import random

    from scheduler_svc.policy.vlt import lag_anchor

    def definition(r: Request, now: float) -> tuple[float, ...]:
        gap, lengths = lvf.gap_s, lvf.lengths
        if is_late(r, now, gap):
            return (1.0, lag_anchor(r, params, gap, lengths), r.arrival_time)
        return (0.0, -vlt(r, now, params, gap, lvf.lag_unit_s, lengths), r.arrival_time)

    rng = random.Random(3)
    lvf = make_policy("lvf", params)
    seen = set()
    for i in range(2000):
        # No batch seen yet, then gaps from a fifth of the SLO to over it.
        lvf.gap_s = None if i < 500 else rng.choice([0.01, 0.04, 0.09, 0.6])
        lvf.lengths = rng.choice(LENGTHS_SEEN)
        lvf.set_lag_unit(rng.choice([None, 20.0, 7.0]))
        now = rng.uniform(0.0, 100.0)
        slo = SLO(rng.choice([1.0, 5.0, 20.0]), rng.choice([0.05, 0.1, 0.5]))
        state = rng.choice([RequestState.WAITING, RequestState.ROTARY, RequestState.RUNNING])
        started = rng.random() < 0.6
        r = req(f"k{i}", rng.uniform(0.0, now), state, slo=slo,
                last_token=rng.uniform(0.0, now) if started else None,
                run_start=rng.uniform(0.0, now) if state is RequestState.RUNNING else None,
                max_tokens=rng.choice([100, 8000]), eos=rng.random() < 0.5)
        if started:
            r.output_token_ids = [1] * rng.randint(1, 300)
            r.num_placeholders = rng.randint(0, 1)
        key = lvf.merge_key(r, now)
        assert key == definition(r, now)
        seen.add((state, started, key[0]))
        # slack_s inlines deadline() too (admission asks it of every parked candidate).
        slack = deadline(r, lvf.gap_s, lvf.lengths) - now
        assert lvf.slack_s(r, now) == (slack if slack >= 0.0 else None)
    assert len(seen) == 12  # every state, started or not, late and on time


@pytest.mark.parametrize("params", PARAMS_VARIANTS)
def test_lvf_running_order_is_the_vlt_definitions(params: VLTParams) -> None:
    """LVF ranks the running requests with vlt()'s arithmetic inlined, once per iteration,
    and may_preempt reuses those VLTs for its victims at the same time: the order is the
    sort by running_merge_key, each VLT is vlt()'s bit for bit, and every answer is that of
    a policy that ranked nobody."""
    import random

    rng = random.Random(5)
    lvf, plain = make_policy("lvf", params), make_policy("lvf", params)
    for trial in range(300):
        gap = None if trial < 60 else rng.choice([0.01, 0.04, 0.09, 0.6])
        lvf.gap_s = plain.gap_s = gap
        lvf.lengths = plain.lengths = lengths = rng.choice(LENGTHS_SEEN)
        unit = rng.choice([None, 20.0])
        lvf.set_lag_unit(unit)
        plain.set_lag_unit(unit)
        now = round(rng.uniform(10.0, 100.0), 1)
        running = []
        for i in range(rng.randint(0, 40)):
            slo = SLO(rng.choice([1.0, 5.0, 20.0]), rng.choice([0.05, 0.1, 0.5]))
            arrival = round(rng.uniform(0.0, now), 1)  # coarse: ties happen
            started = rng.random() < 0.7
            r = req(f"o{trial}-{i}", arrival, RequestState.RUNNING, slo=slo,
                    last_token=round(rng.uniform(arrival, now), 1) if started else None,
                    run_start=rng.choice([None, round(rng.uniform(arrival, now), 1)]))
            if started:
                r.output_token_ids = [1] * rng.randint(1, 300)
                r.num_placeholders = rng.randint(0, 1)
                r.sampling = SamplingParams(max_tokens=rng.choice([50, 400, 4000]))
                if rng.random() < 0.5:  # its length not known: it may end by EOS
                    r.eos_token_ids, r.length_known = (2,), False
            if rng.random() < 0.1:  # vlt()'s branch for a request with no token, not running
                r.state = RequestState.WAITING
            running.append(r)
        order = lvf.running_order(running, now)
        assert order == sorted(running, key=lambda r: lvf.running_merge_key(r, now))
        at, ranked = lvf._ranked
        assert at == now
        assert all(ranked[r.request_id] == vlt(r, now, params, gap, unit, lengths)
                   for r in running)
        candidates = [req(f"c{trial}-{j}", round(rng.uniform(0.0, now), 1)) for j in range(3)]
        for when in (now, now + 0.5):  # at another time the ranking does not count
            for v in running:
                for c in candidates:
                    assert lvf.may_preempt(v, c, when) == plain.may_preempt(v, c, when)


def test_scheduler_merge_is_heapq_merge() -> None:
    """The scheduler's lazy merge (galloping through a run's lead) yields heapq.merge's
    order: by key, equal keys from the earlier run first."""
    import heapq
    import random

    from scheduler_svc.policy.merge import merge as _merge

    rng = random.Random(11)
    for trial in range(200):
        runs = []
        for j in range(rng.randint(1, 5)):
            top = rng.choice([3, 8, 40, 400])  # few distinct keys (long leads, ties) or many
            keys = sorted(rng.randint(0, top) for _ in range(rng.randint(0, 60)))
            runs.append([((k,), n, req(f"m{trial}-{j}-{n}", float(k))) for n, k in enumerate(keys)])

        def key(r: Request, now: float) -> tuple[float, ...]:
            return (r.arrival_time,)

        want = [e[2] for e in heapq.merge(*runs, key=lambda e: key(e[2], 0.0))]
        assert list(_merge(runs, key, 0.0)) == want


def test_lvf_rotates_out_the_running_request_furthest_ahead_of_its_deadline() -> None:
    """Victims come from the tail of the running order: the request with the most slack
    goes first, however long it has run (LVF used to rank running requests by time since
    admission, and rotated a request out a batch or two after it came back behind its
    pace)."""
    now = 10.0
    lvf = make_policy("lvf", VLTParams(), RotationLimits.bare())
    back = req("back", 0.0, RequestState.RUNNING, last_token=9.9, run_start=9.95)
    back.first_token_time, back.output_token_ids = 4.0, [1] * 50  # due 9.0: behind
    ahead = req("ahead", 0.0, RequestState.RUNNING, last_token=9.9, run_start=1.0)
    ahead.first_token_time, ahead.output_token_ids = 5.0, [1] * 60  # due 11.0: 1 s ahead
    order = lvf.running_order([ahead, back], now)
    assert [r.request_id for r in order] == ["back", "ahead"]  # "ahead" is the first victim
    fresh = req("fresh", arrival=9.0)  # 4 s of TTFT slack: VLT -0.8, "ahead" -0.67
    assert not lvf.may_preempt(ahead, fresh, now) and not lvf.may_preempt(back, fresh, now)
    assert lvf.may_preempt(ahead, req("old", arrival=6.0), now)  # 1 s of slack: -0.2


def test_lvf_refiles_its_queues_when_the_batch_time_moves() -> None:
    """A parked request's deadline depends on the measured time between tokens, so its
    place in the rotary queue does too: when the mean moves by more than a tenth, LVF says
    so and the queue is re-filed (as the scheduler does), keeping the lazy order the
    definition's. Without the re-filing the order below would be stale. (No stall bound:
    with it both would rank by their last tokens here, whatever the gap.)"""
    from scheduler_svc.policy.merge import merge as _merge
    from scheduler_svc.queue import RequestQueue

    lvf = make_policy("lvf", VLTParams(max_stall=None))
    rotary = RequestQueue(lambda r: lvf.order_key(r, True))
    # Both parked since their 10th token: "long" due at 5.8 with 190 tokens to go, "short"
    # due at 5.9 with 20.
    for rid, max_tokens, first in (("long", 200, 4.8), ("short", 30, 4.9)):
        r = req(rid, 0.0, RequestState.ROTARY, last_token=first)
        r.sampling = SamplingParams(max_tokens=max_tokens)
        r.output_token_ids = [1] * 10
        rotary.append(r)

    def lazy_and_plain(now: float) -> tuple[list[str], list[str]]:
        runs = lvf.candidate_runs(rotary.groups(), now)
        return ([r.request_id for r in _merge(runs, lvf.merge_key, now)],
                [r.request_id for r in lvf.candidates([], rotary.list(), now)])

    # No batch seen: both late at 7.0, oldest deadline first.
    assert lazy_and_plain(7.0) == (["long", "short"], ["long", "short"])
    assert lvf.observe_iteration(0.02)  # the first batch sets the deadlines' gap
    assert lazy_and_plain(7.0)[0] != lazy_and_plain(7.0)[1]  # stale until re-filed
    rotary.refile()
    # At 20 ms "long" wins back 190 × 0.08 − 0.1 s (deadline 20.9), "short" 1.5 s (7.4).
    assert lazy_and_plain(7.0) == (["short", "long"], ["short", "long"])
    assert not lvf.observe_iteration(0.021)  # within a tenth: the keys stand
    assert all(lvf.observe_iteration(0.2) for _ in range(3))  # the mean climbs past 10 %
    rotary.refile()
    lazy, plain = lazy_and_plain(7.0)
    assert lazy == plain


def test_a_prompt_chunk_leaves_a_token_for_each_decode_behind_it() -> None:
    """LVF orders a request that is still prefilling before decodes that lead their pace.
    Its chunk may take the budget only down to one token per running request after it:
    a decode left out of the batch misses its gap (docs/results/rotasched/)."""
    t = [0.0]
    s = Scheduler(SchedulerConfig(num_device_blocks=16, num_host_blocks=64, block_size=4,
                                  max_batched_tokens=8, eager_budget_blocks=0),
                  make_policy("lvf", P, RotationLimits.bare()), clock=lambda: t[0])
    for i in range(4):
        s.add_request(Request(f"d{i}", [7], SamplingParams(max_tokens=50), 0.0))
    out = s.schedule()  # four one-token prompts: each samples its first token
    s.update_from_output(out, _sampled(out))
    s.add_request(Request("long", list(range(30)), SamplingParams(max_tokens=50), 0.0))
    # A prompt that cannot fit beside them: memory binds, so LVF orders by VLT.
    s.add_request(Request("huge", list(range(40)), SamplingParams(max_tokens=50), 0.0))
    out = s.schedule()  # the decodes, then "long" admitted with what is left
    s.update_from_output(out, _sampled(out))
    assert not s.everything_fits() and s.requests["long"].num_computed_tokens == 4
    lvf = s.policy
    assert lvf.running_order(s.running.list(), t[0])[0].request_id == "long"
    out = s.schedule()
    tokens = {c.request_id: len(c.token_ids) for c in out.chunks}
    assert tokens == {"long": 4, "d0": 1, "d1": 1, "d2": 1, "d3": 1}


def test_max_stall_caps_a_parked_streams_slack_but_never_makes_it_late() -> None:
    """The CPU stack's case (S_B 10 s, S_F 0.3 s, 20 ms iterations): a request parked 16
    tokens into 64, streamed at 20 ms, keeps 13 s of catch-up past its due time, so without
    a bound new requests outrank it for that long (measured: 16-18 s stalls per pass,
    docs/results/rotasched/). With max_stall m its slack counts only until m·S_B after
    its last token; whether it is late still follows its deadline."""
    from scheduler_svc.policy.vlt import lag_anchor

    slo = SLO(10.0, 0.3)
    for cap in (None, 0.25):
        lvf = make_policy("lvf", VLTParams(max_stall=cap))
        lvf.observe_iteration(0.02)
        parked = req("parked", -1.0, RequestState.ROTARY, last_token=0.0, slo=slo)
        parked.first_token_time, parked.output_token_ids = -0.3, [1] * 16
        parked.sampling = SamplingParams(max_tokens=64)
        # due at -0.3 + 16 × 0.3 = 4.5, plus 48 × 0.28 − 0.3 of catch-up
        assert deadline(parked, lvf.gap_s) == pytest.approx(4.5 + 48 * 0.28 - 0.3)
        assert lag_anchor(parked, lvf.params, lvf.gap_s) == pytest.approx(
            4.5 + 48 * 0.28 - 0.3 if cap is None else 2.5)
        new = req("new", 2.0, slo=slo)  # 9 s of TTFT slack at 3.0
        order = [r.request_id for r in lvf.candidates([new], [parked], 3.0)]
        assert order == (["new", "parked"] if cap is None else ["parked", "new"])
        assert not lvf.is_late(parked, 17.0) and lvf.is_late(parked, 18.0)
        # Running, the same request keeps its whole slack: victims are still chosen by it.
        parked.state = RequestState.RUNNING
        assert lag_anchor(parked, lvf.params, lvf.gap_s) == pytest.approx(4.5 + 48 * 0.28 - 0.3)


def test_lvf_rules_reach_the_simulator_from_a_policy_spec_and_have_no_serve_flag() -> None:
    """LVF's rules are no server setting (common/scheduling.py): the experiments vary
    them through the simulator's policy specs, nothing else reaches them."""
    from common.config import EngineConfig
    from superinfer.sim.engine import PolicyVariant, SimConfig

    assert PolicyVariant.parse("lvf:stall=0.5").apply(SimConfig()).vlt.max_stall == 0.5
    half = SimConfig(vlt=VLTParams(max_stall=0.5))
    assert PolicyVariant.parse("lvf:stall=none").apply(half).vlt.max_stall is None
    assert PolicyVariant.parse("lvf:parked_first=on").apply(SimConfig()).limits.parked_first
    assert PolicyVariant.parse("lvf:cover=2").apply(SimConfig()).limits.park_cover == 2.0
    assert PolicyVariant.parse("lvf:memory_margin=3").apply(SimConfig()).limits.memory_margin == 3.0
    for name in ("max_stall", "parked_first", "park_cover", "memory_margin", "alpha"):
        with pytest.raises(TypeError):
            EngineConfig(**{name: 1.0})


@pytest.mark.parametrize("cover", [None, 1.0, 2.0])
def test_park_cover_spares_a_victim_without_the_slack_to_sit_out_a_typical_park(
        cover: float | None) -> None:
    """Parked requests have stayed parked 2 s on average. A running request 1.5 s ahead of
    its deadline, parked that long, would miss its TPOT: with park_cover 1 it is no victim,
    one 3 s ahead still is; with 2, neither is. Off (None), both are, as is every victim
    before a single park was seen."""
    now = 10.0
    lvf = make_policy("lvf", VLTParams(), RotationLimits.bare(park_cover=cover))
    assert isinstance(lvf, LVFPolicy)
    old = req("old", arrival=6.0)  # 1 s of TTFT slack left: lags more than either victim
    victims = []
    for rid, ahead, k in (("near", 1.5, 65), ("far", 3.0, 80)):
        v = req(rid, 0.0, RequestState.RUNNING, last_token=9.9, run_start=1.0)
        v.first_token_time, v.output_token_ids = 5.0, [1] * k  # due 5 + k * 0.1 s
        assert deadline(v, lvf.gap_s) - now == pytest.approx(ahead)
        victims.append(v)
    assert all(lvf.may_preempt(v, old, now) for v in victims)  # no park seen yet
    parked = req("p", 0.0, RequestState.RUNNING, last_token=3.0)
    parked.set_state(RequestState.ROTARY, 3.0)
    lvf.observe_park(parked, 5.0)  # parked 3.0 -> 5.0
    assert lvf.park_s(parked.slo) == pytest.approx(2.0)
    assert lvf.park_s(SLO(1.0, 0.05)) is None  # per SLO class
    expect = {None: [True, True], 1.0: [False, True], 2.0: [False, False]}[cover]
    assert [lvf.may_preempt(v, old, now) for v in victims] == expect
    prefilling = req("pf", 0.0, RequestState.RUNNING, run_start=2.0)  # no token: no TPOT yet
    assert lvf.may_preempt(prefilling, old, now)


def test_rotation_limits_refuse_values_out_of_range_wherever_they_are_set() -> None:
    """RotationLimits checks its own fields; a simulator policy spec reports the same as a
    SimulationError."""
    from superinfer.sim.engine import PolicyVariant, SimConfig, SimulationError

    with pytest.raises(ValueError, match="xfer_budget_blocks"):
        RotationLimits(xfer_budget_blocks=-1)
    bad = {"min_residency": ("min_res", -1), "iteration_budget": ("tbt_budget", 1.5),
           "prefill_within": ("prefill", 0.0), "lazy_margin": ("lazy_margin", -0.1),
           "park_cover": ("cover", 0.0), "memory_margin": ("memory_margin", -1.0)}
    for field, (key, value) in bad.items():
        with pytest.raises(ValueError, match=field):
            RotationLimits(**{field: value})
        with pytest.raises(SimulationError, match=field):
            PolicyVariant.parse(f"lvf:{key}={value}").apply(SimConfig())
    RotationLimits(xfer_budget_blocks=0, iteration_budget=0.0, prefill_within=1.0,
                   park_cover=0.5)  # the edges that are allowed


def test_serve_and_the_simulator_build_the_same_policy_by_default() -> None:
    """`superinfer serve` and `superinfer sim` give LVF the same VLT parameters and
    rotation limits (the policy's own defaults, declared once in policy/) and the same
    settings (common/scheduling.py); B_xfer auto is left for the engine to size."""
    from common.config import EngineConfig
    from scheduler_svc.setup import policy_from, rotation_limits
    from superinfer.sim.engine import SimConfig

    engine, sim = EngineConfig(), SimConfig()
    assert rotation_limits(engine) == sim.limits == RotationLimits()
    assert sim.vlt == VLTParams()
    lvf = policy_from(engine)
    assert isinstance(lvf, LVFPolicy) and lvf.params == VLTParams()
    assert lvf.limits == RotationLimits() and lvf.limits.xfer_budget_blocks is None


def test_with_the_stall_bound_late_parked_requests_leave_their_run_from_any_place() -> None:
    """A rotary run is sorted by lag anchor. Without the bound that is the deadline, so the
    late requests are its prefix; with it a request with much slack but an old last token
    sorts before late ones, and the lazy merge must still yield the plain order."""
    import random

    from scheduler_svc.policy.merge import merge as _merge
    from scheduler_svc.queue import RequestQueue

    rng = random.Random(1)
    for trial in range(20):
        lvf = make_policy("lvf", VLTParams(max_stall=0.25))
        if trial % 2:
            lvf.observe_iteration(0.02)
        rotary = RequestQueue(lambda r, p=lvf: p.order_key(r, True))
        waiting = RequestQueue(lambda r, p=lvf: p.order_key(r, False))
        for i in range(40):
            last = rng.uniform(50.0, 100.0)
            r = req(f"r{trial}-{i}", 0.0, RequestState.ROTARY, last_token=last)
            r.first_token_time, r.output_token_ids = rng.uniform(0.0, last), [1] * rng.randint(1, 800)
            r.sampling = SamplingParams(max_tokens=rng.choice([900, 4000]))
            rotary.append(r)
        for i in range(10):
            waiting.append(req(f"n{trial}-{i}", rng.uniform(90.0, 100.0)))
        runs = lvf.candidate_runs(waiting.groups() + rotary.groups(), 100.0)
        lazy = [r.request_id for r in _merge(runs, lvf.merge_key, 100.0)]
        plain = [r.request_id for r in lvf.candidates(waiting.list(), rotary.list(), 100.0)]
        assert lazy == plain
