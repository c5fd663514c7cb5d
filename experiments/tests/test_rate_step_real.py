"""The real-stack rate step's parts that need no stack: LVF's rules set from the experiments
folder (experiments/rules_scheduler.py), the step trace, and the per-phase scoring."""

from __future__ import annotations

import math
from typing import Any

import pytest


@pytest.fixture
def patched() -> Any:
    """rules_scheduler.install, undone after the test."""
    from experiments.rules_scheduler import install

    undo: list[Any] = []
    yield lambda rules: undo.append(install(rules))
    for u in undo:
        u()


def test_rules_parse_to_rotation_limits_fields_of_their_types() -> None:
    from experiments.rules_scheduler import format_rules, parse_rules

    rules = parse_rules("adapt_residency=off,min_residency=0")
    assert rules == {"adapt_residency": False, "min_residency": 0}
    assert parse_rules("") == {}
    got = parse_rules("memory-margin=3, park_cover=none,xfer_budget_blocks=64,lazy_rotation=on")
    assert got == {"memory_margin": 3.0, "park_cover": None, "xfer_budget_blocks": 64,
                   "lazy_rotation": True}
    assert isinstance(got["memory_margin"], float)
    assert parse_rules(format_rules(got)) == got  # the text a child gets parses back


@pytest.mark.parametrize(("text", "says"), [
    ("min_residncy=0", "unknown rule 'min_residncy'; RotationLimits has: adapt_residency"),
    ("adapt_residency=maybe", "rule 'adapt_residency' is on or off"),
    ("min_residency=1.5", "rule 'min_residency' takes an integer"),
    ("memory_margin=none", "rule 'memory_margin' cannot be none"),
    ("min_residency=-1", "min_residency must be >= 0"),  # RotationLimits' own check
    ("min_residency", "expected KEY=VALUE"),
    ("min_residency=1,min_residency=2", "given twice"),
])
def test_a_bad_rule_is_refused_with_a_clear_message(text: str, says: str) -> None:
    from experiments.rules_scheduler import RulesError, parse_rules

    with pytest.raises(RulesError) as e:
        parse_rules(text)
    assert says in str(e.value)


def test_a_bad_rule_stops_the_scheduler_before_it_starts(capsys: Any) -> None:
    from experiments.rules_scheduler import main

    assert main(["--rules", "nope=1", "--port", "1"]) == 2
    assert "unknown rule 'nope'" in capsys.readouterr().err
    assert main(["--port", "1"]) == 2  # --rules is required
    assert "--rules is required" in capsys.readouterr().err


def test_the_patched_setup_builds_the_scheduler_policy_with_the_overrides(patched: Any) -> None:
    from common.config import EngineConfig
    from scheduler_svc import setup
    from scheduler_svc.policy.base import RotationLimits

    cfg = EngineConfig(policy="lvf", xfer_budget_blocks=64)
    from scheduler_svc.policy.lvf import LVFPolicy

    before = setup.policy_from(cfg)
    assert isinstance(before, LVFPolicy)
    assert not before.limits.adapt_residency and before.limits.min_residency == 32
    assert before.residency is None  # fixed, the default
    patched({"adapt_residency": True, "min_residency": 0, "memory_margin": 3.0})
    policy = setup.policy_from(cfg)  # what build_scheduler calls in the scheduler service
    assert isinstance(policy, LVFPolicy)
    assert policy.limits == RotationLimits(xfer_budget_blocks=64, adapt_residency=True,
                                           min_residency=0, memory_margin=3.0)
    from scheduler_svc.queue import RequestQueue

    assert policy.residency is not None and policy.min_residency(RequestQueue(), 8, 0.0) == 0
    sched = setup.build_scheduler(cfg, 64, 128, 2048)  # the service's own path
    assert sched.policy.limits.min_residency == 0 and sched.policy.limits.adapt_residency


def test_install_is_undone_and_refuses_to_stack(patched: Any) -> None:
    from common.config import EngineConfig
    from experiments.rules_scheduler import install
    from scheduler_svc import setup

    original = setup.rotation_limits
    undo = install({"min_residency": 8})
    try:
        assert setup.policy_from(EngineConfig(policy="lvf")).limits.min_residency == 8
        with pytest.raises(RuntimeError, match="already overridden"):
            install({"min_residency": 4})
    finally:
        undo()
    assert setup.rotation_limits is original
    assert setup.policy_from(EngineConfig(policy="lvf")).limits.min_residency == 32


def test_serve_runs_the_scheduler_child_through_rules_scheduler(tmp_path: Any) -> None:
    import sys

    from experiments.rules_scheduler import split_argv, swap_scheduler
    from superinfer.cli import build_parser
    from superinfer.services_cli import service_specs

    argv = ["serve", "--run-dir", str(tmp_path), "--device-blocks", "64", "--policy", "lvf"]
    specs = service_specs(build_parser(argv).parse_args(argv))
    swapped = swap_scheduler(specs, "min_residency=0")
    for a, b in zip(specs, swapped, strict=True):
        if a.name != "scheduler":
            assert b.argv == a.argv
            continue
        assert b.argv[:5] == [sys.executable, "-m", "experiments.rules_scheduler", "--rules",
                              "min_residency=0"]
        assert b.argv[5:] == a.argv[4:]  # the scheduler's own flags, unchanged
        assert b.probe is a.probe and b.pid_file == a.pid_file
        rules, serve, rest = split_argv(b.argv[3:])
        assert (rules, serve, rest) == ("min_residency=0", False, a.argv[4:])
    assert split_argv(["--rules=", "--serve", "--port", "9"]) == ("", True, ["--port", "9"])


def test_variants_resolve_to_checked_rules() -> None:
    from experiments.rate_step_real import resolve_variants

    assert resolve_variants("adaptive,fixed32,fixed0", []) == {
        "adaptive": "adapt_residency=on", "fixed32": "", "fixed0": "min_residency=0"}
    assert resolve_variants("fixed0", ["f8=min_residency=8"]) == {
        "fixed0": "min_residency=0", "f8": "min_residency=8"}
    for names, defined, says in (("nope", [], "unknown variant 'nope'"),
                                 ("x", ["x=min_res=3"], "unknown rule 'min_res'"),
                                 ("fixed0,fixed0", [], "named twice")):
        with pytest.raises(ValueError, match=says):
            resolve_variants(names, defined)


def test_the_step_trace_is_one_seeded_segment_per_phase() -> None:
    from experiments.rate_step_real import bounds_of, parse_phases, phases_of, step_trace
    from superinfer.workload import WorkloadSpec, build_trace

    phases = phases_of(2.0, 4.0, 30.0)
    assert parse_phases("2:30,4:30,2:30") == phases
    spec = WorkloadSpec(dataset="sharegpt", rps=2.0, duration_s=90.0, seed=11,
                        max_prompt_len=384, max_output_len=64)
    trace = step_trace(spec, phases, build_trace)
    assert [r.index for r in trace] == list(range(len(trace)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:]))
    counts = [sum(lo <= r.arrival_s < hi for r in trace) for lo, hi in bounds_of(phases)]
    assert sum(counts) == len(trace) and counts[1] > counts[0] and counts[1] > counts[2]
    assert 30 <= counts[0] <= 95 and 80 <= counts[1] <= 170  # ~60 and ~120
    # Phase 2 starts at 30 s with its own stream; the same arguments give the same trace.
    assert min(r.arrival_s for r in trace if r.arrival_s >= 30.0) == 30.0
    assert step_trace(spec, phases, build_trace) == trace
    with pytest.raises(ValueError, match="RATE:SECONDS"):
        parse_phases("2:30,x")


def _bench(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """A bench serve JSON with one pass, its per-request details from (scheduled, sent,
    token times from sent, error)."""
    per = [{"index": i, "scheduled_s": r["at"], "sent_s": r["at"] + 0.01,
            "token_times_s": r["tokens"], "trace_prompt_len": 10, "trace_output_len": 5,
            "slo_class": None, "prompt_tokens": 10, "error": r.get("error")}
           for i, r in enumerate(reqs)]
    return {"config": {"ttft_slo_s": 10.0, "tbt_slo_s": 0.3, "slo_classes": None},
            "results": [{"per_request": per, "rotations": 0, "failed": 0}]}


def test_requests_are_scored_by_the_phase_their_arrival_falls_in() -> None:
    from experiments.rate_step_real import format_table, score, trace_digest

    good = [1.0, 1.2, 1.4, 1.6]  # TTFT 1 s, gaps 0.2 s
    bench = _bench([
        {"at": 0.0, "tokens": good},
        {"at": 5.0, "tokens": [11.0, 11.2]},  # TTFT 11 s: misses TTFT (and joint)
        {"at": 10.0, "tokens": good},  # phase 2 from here
        {"at": 12.0, "tokens": [1.0, 1.2, 3.2, 3.4]},  # one 2 s gap: TPOT 0.8 s misses
        {"at": 15.0, "tokens": [1.0], "error": "boom"},  # failed: not finished
        {"at": 19.9, "tokens": good},
        {"at": 25.0, "tokens": []},  # phase 3: no token at all
    ])
    phases = [(0.5, 10.0), (1.0, 10.0), (0.5, 10.0)]
    p1, p2, p3 = score(bench, phases)
    assert (p1["phase"], p1["rate"], p1["requests"]) == (1, 0.5, 2)
    assert p1["ttft"] == 0.5 and p1["tbt"] == 1.0 and p1["tpot"] == 1.0 and p1["joint"] == 0.5
    assert p1["goodput"] == pytest.approx(0.1)  # one good request in 10 s
    assert p2["requests"] == 4 and p2["ttft"] == 1.0
    assert p2["tbt"] == pytest.approx(8 / 9)  # one gap of 9 over 0.3 s
    assert p2["tpot"] == pytest.approx(2 / 3)  # the one-token request has no TPOT
    assert p2["joint"] == 0.5 and p2["goodput"] == pytest.approx(0.2)  # the failed one: no
    assert p2["failed"] == 1 and p2["tpot_missed"] == 1
    assert p3["requests"] == 1 and p3["ttft"] == 0.0 and p3["joint"] == 0.0
    assert p3["tbt"] is None and p3["tpot"] is None and p3["goodput"] == 0.0
    text = format_table({"adaptive": [p1, p2, p3]})
    assert "P2 @ 1" in text and "88.9" in text and "66.7" in text
    assert trace_digest(bench) == trace_digest(_bench([
        {"at": r["scheduled_s"], "tokens": []} for r in bench["results"][0]["per_request"]]))
    assert not math.isnan(p1["goodput"])


def test_fairness_is_set_on_the_scheduler_built_by_the_service_path(patched: Any) -> None:
    """`fairness=global` (not a rotation rule) reaches SchedulerConfig, for the real-stack
    tenant study (experiments/tenant_shares_real.py); a bad value is refused."""
    from common.config import EngineConfig
    from experiments.rules_scheduler import RulesError, parse_rules
    from scheduler_svc import setup

    cfg = EngineConfig(policy="lvf")
    assert setup.build_scheduler(cfg, 64, 128, 2048).config.fairness == "shares"
    patched(parse_rules("fairness=global,min_residency=0"))
    sched = setup.build_scheduler(cfg, 64, 128, 2048)
    assert sched.config.fairness == "global" and sched.shares.mode == "global"
    assert sched.policy.limits.min_residency == 0
    with pytest.raises(RulesError, match="fairness is one of"):
        parse_rules("fairness=fifo")
