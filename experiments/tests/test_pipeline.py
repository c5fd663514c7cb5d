"""`python -m experiments pipeline`: what it counts as the pipeline's compute share."""

from __future__ import annotations

import pytest


def test_the_pipeline_study_compute_share_counts_only_the_measured_run(tmp_path) -> None:  # noqa: ANN001
    """`python -m experiments pipeline` measures from the first batch after `since` (the warm-up and the
    pause after it, when the worker has no request, are not the pipeline's idle time); the
    trace says where its clock starts, so another process's moment can be placed on it."""
    from experiments.pipeline import compute_share
    from scheduler_svc.trace import Trace, clock_origin, load_trace

    now = [1000.0]
    trace = Trace(tmp_path / "t.json", clock=lambda: now[0])

    def batch(start: float, compute: float) -> None:
        trace.span("execute", "execute", 1000.0 + start, compute, {"compute_s": compute})

    batch(0.0, 0.01)  # warm-up
    batch(1.0, 0.09)  # the measured run: 0.2 s of compute in 0.21 s, a 10 ms wait inside
    trace.span("transfer D2H", "transfer wait", 1000.0 + 1.092, 0.01)
    batch(1.1, 0.11)
    trace.close()
    events = load_trace(tmp_path / "t.json")
    assert clock_origin(events) == 1000.0
    measured = compute_share(events, since=1000.5)
    assert measured["batches"] == 2
    assert measured["compute_share"] == pytest.approx(0.2 / 0.21)
    assert measured["idle_between_batches_s"] == pytest.approx(0.01)
    assert measured["idle_in_transfer_wait_s"] == pytest.approx(0.008)
    whole = compute_share(events)
    assert whole["batches"] == 3 and whole["compute_share"] == pytest.approx(0.21 / 1.21)
