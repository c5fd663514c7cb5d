"""Who misses TPOT in a `superinfer sim` run: the requests whose mean gap exceeded S_F
against those that met it, by output length, rotations, longest gap and arrival.

    .venv/bin/python docs/sim/issue18/cover1_1204/tpot_misses_probe.py --hardware gh200-96gb \\
        --model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --rps 20 \\
        --policies lvf --jobs 1

(one rate, one policy, --jobs 1: the records are collected in this process.)
"""

from __future__ import annotations

import collections
import statistics as st
import sys

from superinfer import slo_metrics
from superinfer.sim.cli import main as sim_main
from superinfer.slo_metrics import RequestRecord

RECORDS: list[RequestRecord] = []
_from_request = RequestRecord.from_request.__func__  # type: ignore[attr-defined]


def _recording(cls: type, req: object, slo_class: str | None = None,
               now: float | None = None) -> RequestRecord:
    rec = _from_request(cls, req, slo_class, now)
    RECORDS.append(rec)
    return rec


def describe(recs: list[RequestRecord], name: str) -> None:
    if not recs:
        return
    n = [len(r.token_times) for r in recs]
    rot = [r.rotations for r in recs]
    gap = [max(r.gaps()) for r in recs]
    print(f"{name}: {len(recs)} out p50 {st.median(n)} mean {st.mean(n):.0f}; rotations mean "
          f"{st.mean(rot):.2f} zero {sum(x == 0 for x in rot)}; maxgap p50 {st.median(gap):.2f} "
          f"mean {st.mean(gap):.2f}; arrival p50 {st.median(r.arrival_s for r in recs):.1f}; "
          f"tpot p50 {st.median(r.tpot_s() or 0.0 for r in recs):.3f}")


def by(label: str, key, miss: list[RequestRecord], ok: list[RequestRecord]) -> None:
    a = collections.Counter(key(r) for r in miss)
    b = collections.Counter(key(r) for r in ok)
    print(f"by {label} miss/ok:", sorted((k, a[k], b[k]) for k in set(a) | set(b)))


def main(argv: list[str]) -> None:
    slo_metrics.RequestRecord.from_request = classmethod(_recording)  # type: ignore[method-assign, assignment]
    try:
        sim_main(["sim", *argv])
    except SystemExit:
        pass
    timed = [r for r in RECORDS if r.tpot_s() is not None]
    miss = [r for r in timed if (r.tpot_s() or 0.0) > r.tbt_slo_s]
    ok = [r for r in timed if (r.tpot_s() or 0.0) <= r.tbt_slo_s]
    describe(miss, "miss")
    describe(ok, "ok")
    by("output len bucket", lambda r: min(len(r.token_times) // 50, 10) * 50, miss, ok)
    by("arrival", lambda r: int(r.arrival_s // 20) * 20, miss, ok)
    by("rotations", lambda r: min(r.rotations, 6), miss, ok)


if __name__ == "__main__":
    main(sys.argv[1:])
