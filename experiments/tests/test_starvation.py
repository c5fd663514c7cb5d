"""`python -m experiments starvation`: its breakdown of who misses."""

from __future__ import annotations

import pytest


def test_starvation_breakdown_counts_stalls_and_drained_misses() -> None:
    """The starvation study counts what it says: misses, drained misses, stalls."""
    from experiments import starvation as mod
    from superinfer.slo_metrics import RequestRecord

    recs = [
        RequestRecord("a", 0.0, [0.5, 0.55, 30.55], 5.0, 0.1, prompt_tokens=40),  # one 30 s stall
        RequestRecord("b", 1.0, [12.0, 12.05], 5.0, 0.1, prompt_tokens=600),  # served after end
        RequestRecord("c", 2.0, [], 5.0, 0.1, prompt_tokens=300, finished=False),  # never served
    ]
    b = mod.breakdown(recs, arrivals_end_s=10.0)
    assert (b["ttft_misses"], b["ttft_misses_long_prompt"], b["ttft_misses_after_arrivals_end"]) == (2, 2, 2)
    assert b["gaps"] == 3 and b["missed_gaps"] == 1
    assert b["stall_s"] == pytest.approx(30.0) and b["max_gap_s"] == pytest.approx(30.0)
    assert b["median_prompt_hit"] == 40
