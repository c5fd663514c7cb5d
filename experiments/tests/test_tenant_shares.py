"""`python -m experiments tenant-shares`: a few seconds of its flood, end to end."""

from __future__ import annotations

import json

KEYS = {"a_ttft_solo", "a_ttft_flood", "a_tbt_solo", "a_tbt_flood", "a_p99_ttft_ratio",
        "policy", "where"}


def test_tiny_flood_shares_keep_a_where_global_does_not() -> None:
    """A at a quarter of its capacity, B at 2x its own, 20 s of arrivals (in 12 s B's queue
    has not built yet): under `shares` A's TTFT holds, under `global` B's queue takes it."""
    from experiments import tenant_shares as mod

    # In this process (jobs=1): no fork of a test worker that has torch's threads up.
    res = mod.study([0], 20.0, jobs=1, rates=(mod.RATE_A, 2 * mod.CAP_B), full=False)
    runs = json.loads(json.dumps(res["runs"]))  # what results.json holds
    by = {r["policy"]: r for r in runs}
    assert set(by) == {"shares", "global", "vtc"}
    for r in runs:
        assert KEYS <= set(r) and r["where"] == "simulator"
        assert 0.0 <= r["a_ttft_flood"] <= 1.0 and 0.0 <= r["a_tbt_flood"] <= 1.0
    assert by["shares"]["a_ttft_flood"] >= by["shares"]["a_ttft_solo"] - 0.05
    assert by["shares"]["a_ttft_flood"] >= by["global"]["a_ttft_flood"] + 0.10
    assert by["shares"]["a_p99_ttft_flood_s"] < by["global"]["a_p99_ttft_flood_s"]
