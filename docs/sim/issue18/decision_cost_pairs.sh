#!/usr/bin/env bash
# Decision cost of LVF's schedule() (`bench sched`) on two checkouts, interleaved so that
# both see the same machine load: BEFORE (e.g. main's superinfer) and AFTER (this branch's).
#   flock /work/bench.lock bash docs/sim/issue18/decision_cost_pairs.sh \
#       /work/main/.venv/bin/superinfer .venv/bin/superinfer [pairs]
# For each (live requests, seats) row of `bench sched`'s defaults: `pairs` runs of each, in
# ABBA order. One line per run: CPU p50 of one schedule() in ms, then the decision outputs
# (rotations, final running/waiting/rotary), which must agree between the two. Then per row
# the medians and the median per-pair ratio; the rows go to decision_cost.json.
# SAME_DECISIONS=0: the two checkouts' policies differ on purpose (the outputs are then
# reported per side, not required to agree).
set -euo pipefail
BEFORE=$1 AFTER=$2 PAIRS=${3:-5}
OUT=docs/sim/issue18
tmp=$(mktemp -d)
one() {  # one <who> <binary> <live> <seats>
  OMP_NUM_THREADS=1 "$2" bench sched --live "$3" --max-num-seqs "$4" --json "$tmp/run.json" >/dev/null
  python3 - "$1" "$3" "$4" "$tmp/run.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[4]))["results"][0]
print(sys.argv[1], sys.argv[2], sys.argv[3], f"{r['cpu_p50_ms']:.3f}", f"{r['p50_ms']:.3f}",
      r["rotations"], r["running"], r["waiting"], r["rotary"])
EOF
}
for row in "1000 256" "10000 256" "1000 4096" "10000 4096"; do
  for i in $(seq "$PAIRS"); do
    if (( i % 2 )); then one before "$BEFORE" $row; one after "$AFTER" $row
    else one after "$AFTER" $row; one before "$BEFORE" $row; fi
  done
done | tee "$tmp/runs.txt"
python3 - "$tmp/runs.txt" "$OUT/decision_cost.json" <<'EOF'
import json, os, statistics, sys
runs = [line.split() for line in open(sys.argv[1])]
rows = []
for live, seats in sorted({(int(r[1]), int(r[2])) for r in runs}, key=lambda x: (x[1], x[0])):
    mine = [r for r in runs if (int(r[1]), int(r[2])) == (live, seats)]
    same = os.environ.get("SAME_DECISIONS", "1") != "0"
    for side in ("before", "after"):
        outs = {tuple(r[5:]) for r in mine if r[0] == side or same}
        assert len(outs) == 1, f"{live}/{seats}: the runs decided differently ({side})"
    mine.sort(key=lambda r: r[0] != "after")  # the after side's outputs go in the row
    b = [float(r[3]) for r in mine if r[0] == "before"]
    a = [float(r[3]) for r in mine if r[0] == "after"]
    ratios = [x / y for x, y in zip(a, b)]
    rot, running, waiting, rotary = map(int, mine[0][5:])
    rows.append({"live": live, "max_num_seqs": seats, "running": running, "waiting": waiting,
                 "rotary": rotary, "rotations": rot, "runs": len(a),
                 "cpu_p50_ms": statistics.median(a), "cpu_p50_ms_before": statistics.median(b),
                 "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                 "ratio_max": max(ratios), "cpu_p50_ms_runs": a, "cpu_p50_ms_runs_before": b})
    print(f"{live:>6} live {seats:>5} seats: CPU p50 median after {statistics.median(a):.3f} ms, "
          f"before {statistics.median(b):.3f} ms; after/before per pair median "
          f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
json.dump({"policy": "lvf", "what": "bench sched, CPU p50 of one schedule() per run; medians "
           "over interleaved runs (decision_cost_pairs.sh)", "results": rows},
          open(sys.argv[2], "w"), indent=1)
print(f"wrote {sys.argv[2]}")
EOF
rm -rf "$tmp"
