"""`python -m experiments sched`: the decision-cost study runs."""

from __future__ import annotations


def test_the_decision_cost_bench_runs_lvf_with_and_without_the_stall_bound() -> None:
    """`python -m experiments sched --max-stall` (the cost docs/results/rotasched/ quotes):
    both variants reach a steady state with requests running, waiting and rotating."""
    from experiments.sched import measure

    for stall in (None, 0.25):
        r = measure(300, "lvf", iterations=3, max_stall=stall)
        assert r["running"] > 0 and r["waiting"] + r["rotary"] > 0 and r["rotations"] > 0
