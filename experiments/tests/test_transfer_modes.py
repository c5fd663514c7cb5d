"""`python -m experiments transfer-modes`: transfer wait per DuplexKV mode from the real services."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.transfer_modes import summarize

TRIAL = Path(__file__).parent / "data" / "policies_trial.json"


def test_summarize_reads_the_schedulers_counters() -> None:
    row = json.loads(TRIAL.read_text())["results"][0]
    m = row["stats"]["server_metrics_delta"]
    s = summarize("duplex", row)
    wait = m["superinfer_scheduler_transfer_s"]
    assert s["iterations"] == m["superinfer_scheduler_iterations"]
    assert s["transfer_batches"] == m["superinfer_scheduler_transfers"]
    assert s["wait_per_iteration_ms"] == pytest.approx(1e3 * wait / s["iterations"])
    assert s["wait_per_batch_ms"] == pytest.approx(1e3 * wait / s["transfer_batches"])
    assert 0 < s["share_of_iteration_time"] < 1
    assert s["ttft_attainment"] == row["ttft_attainment"]


def test_summarize_reads_the_counters_under_their_prometheus_names() -> None:
    """Passes recorded since the scheduler's statistics became counters (the file above
    holds them as the gauges they were)."""
    m = "superinfer_scheduler_"
    delta = {f"{m}iterations_total": 10.0, f"{m}transfers_total": 4.0,
             f"{m}transfer_seconds_total": 0.2, f"{m}execute_rpc_seconds_total": 1.7,
             f"{m}decision_seconds_total": 0.1, f"{m}rotations_total": 3.0,
             f"{m}transfer_bytes_total{{direction=d2h}}": 2.0 * 2**20,
             f"{m}transfer_bytes_total{{direction=h2d}}": 2.0**20,
             f"{m}kvmem_copy_seconds_total{{direction=d2h}}": 0.03,
             f"{m}kvmem_copy_seconds_total{{direction=h2d}}": 0.01}
    s = summarize("duplex", {"stats": {"server_metrics_delta": delta}})
    assert (s["iterations"], s["transfer_batches"], s["rotations"]) == (10, 4, 3)
    assert (s["mib_d2h"], s["mib_h2d"]) == (2.0, 1.0)
    assert s["wait_per_batch_ms"] == pytest.approx(50.0)
    assert s["share_of_iteration_time"] == pytest.approx(0.1)
    assert s["kvmem_copy_s"] == pytest.approx(0.04)


def test_a_pass_without_server_metrics_is_refused() -> None:
    with pytest.raises(ValueError, match="server_metrics_delta"):
        summarize("duplex", {"stats": {}})


@pytest.mark.slow
def test_two_modes_on_the_real_stack(tmp_path: Path) -> None:
    """Both modes move blocks under rotation pressure and the table says how long it waited."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rc = subprocess.call([sys.executable, "-m", "experiments", "transfer-modes",
                          "--modes", "layer-first,duplex", "--rate", "2", "--duration", "8",
                          "--out", str(tmp_path)], env=env)
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["layer-first", "duplex"]
    for r in rows:
        assert r["transfer_batches"] > 0 and r["mib_h2d"] + r["mib_d2h"] > 0
        assert r["wait_per_iteration_ms"] > 0
    assert "wait_per_iteration_ms" in (tmp_path / "table.md").read_text()


def test_the_experiment_claim_needs_both_policies() -> None:
    """A one-policy run (as transfer-modes makes) neither holds nor fails the claim."""
    from experiments.policies import claim

    row = {"policy": "lvf", "rps": 1.6, "ttft_attainment": 0.9, "tbt_attainment": 0.95}
    assert claim([row])["holds"] is None
    sf = {**row, "policy": "swapped-first", "ttft_attainment": 0.5, "tbt_attainment": 0.97}
    verdict = claim([row, sf])
    assert verdict["holds"] is True and verdict["ttft_gain_points"] == 40.0
