#!/usr/bin/env bash
# LVF on the real stack's simulator twin (real_stack/README.md: the cpu-local-2026-12-01
# profile at 2.1 and 2.8 req/s, its 1.5x and 2x), a commit against the working tree, seeds
# 0-7 (one seed is 100 requests: a request is a point). From the repository root:
#   bash docs/sim/issue18/twin_ab.sh 216256d        # prints the mean of each side per rate
set -euo pipefail
BEFORE=${1:?a commit to compare the working tree against}
PY="${PY:-.venv/bin/python}"
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute; the venv link kept
ROOT=$(pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir "$TMP/before"
git archive "$BEFORE" | tar -x -C "$TMP/before"
T=(--hardware "$ROOT/docs/sim/issue18/real_stack/cpu-local-2026-12-01.json" --model smollm2-135m
   --dataset sharegpt --device-blocks 64 --host-blocks 4096 --max-num-seqs 32
   --max-prompt-len 384 --max-output-len 64 --ttft-slo 10 --tbt-slo 0.3 --num-prompts 100
   --rps 2.1,2.8 --jobs 1 --policies lvf)
for side in before after; do
  dir="$TMP/before"; [ "$side" = after ] && dir="$ROOT"
  for s in 0 1 2 3 4 5 6 7; do
    (cd "$dir" && "$PY" -m superinfer.sim.cli sim "${T[@]}" --seed "$s" --json "$TMP/$side-$s.json" > /dev/null)
  done
done
"$PY" - "$TMP" <<'PYEOF'
import json, statistics, sys
tmp = sys.argv[1]
rows: dict = {}
for side in ("before", "after"):
    for s in range(8):
        for r in json.load(open(f"{tmp}/{side}-{s}.json"))["results"]:
            rows.setdefault((r["rps"], side), []).append(
                (100 * r["ttft_attainment"], 100 * r["tbt_attainment"],
                 100 * r["tpot_attainment"], r["goodput_rps"]))
print("| rate | side | TTFT / per-gap TBT / TPOT % (mean of 8 seeds) | goodput |")
print("|---|---|---|---|")
for (rps, side), v in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] != "before")):
    m = [statistics.mean(x[i] for x in v) for i in range(4)]
    print(f"| {rps:g} | {side} | {m[0]:.1f} / {m[1]:.1f} / {m[2]:.1f} | {m[3]:.3f} |")
PYEOF
