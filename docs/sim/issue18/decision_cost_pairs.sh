#!/usr/bin/env bash
# Decision cost of LVF's schedule() (bench sched) on two checkouts, interleaved so that both
# see the same machine load: BEFORE (e.g. main's superinfer) and AFTER (this branch's).
#   flock /work/bench.lock bash docs/sim/issue18/decision_cost_pairs.sh \
#       /work/main/.venv/bin/superinfer .venv/bin/superinfer [pairs]
# Prints one line per run (CPU p50 of one schedule() at 1,000 live / 256 seats, and the
# decision outputs: rotations and the final running/waiting/rotary counts, which must agree),
# then the median of each and of the per-pair ratios; then the full tables of AFTER (written
# to decision_cost.json) and BEFORE.
set -euo pipefail
BEFORE=$1 AFTER=$2 PAIRS=${3:-7}
OUT=docs/sim/issue18
tmp=$(mktemp -d)
row() {
  OMP_NUM_THREADS=1 "$2" bench sched --live 1000 --max-num-seqs 256 --json "$tmp/$1.json" >/dev/null
  python3 - "$1" "$tmp/$1.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[2]))["results"][0]
print(sys.argv[1], f"{r['cpu_p50_ms']:.3f}", r["rotations"], r["running"], r["waiting"], r["rotary"])
EOF
}
for i in $(seq "$PAIRS"); do
  if (( i % 2 )); then row before "$BEFORE"; row after "$AFTER"; else row after "$AFTER"; row before "$BEFORE"; fi
done | tee "$tmp/pairs.txt"
python3 - "$tmp/pairs.txt" <<'EOF'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
b = [float(r[1]) for r in rows if r[0] == "before"]
a = [float(r[1]) for r in rows if r[0] == "after"]
assert len({tuple(r[2:]) for r in rows}) == 1, "the two checkouts decided differently"
pairs = [x / y for x, y in zip(a, b)]
print(f"median CPU p50: before {statistics.median(b):.3f} ms, after {statistics.median(a):.3f} ms; "
      f"per-pair after/before median {statistics.median(pairs):.2f} (min {min(pairs):.2f}, max {max(pairs):.2f})")
EOF
echo "== after"
OMP_NUM_THREADS=1 "$AFTER" bench sched --live 1000,10000 --json "$OUT/decision_cost.json"
echo "== before"
OMP_NUM_THREADS=1 "$BEFORE" bench sched --live 1000,10000
rm -rf "$tmp"
