#!/usr/bin/env bash
# /tmp/m16/base: `git archive` of main b125476; /tmp/m16/branch: of this branch (3b8ec03);
# /tmp/m16/cpu_spy.py: a copy of ../client/cpu_spy.py.
# Run as `flock /work/bench.lock THIS ROUND...`; results in /tmp/m16/res (copied to res/).
# under flock: CPU per process (2 x 2 runs per side, interleaved), then bench overhead rounds
set -u
PY=/work/wt/metrics/.venv/bin/python
OUT=/tmp/m16/res; mkdir -p $OUT
export PYTHONDONTWRITEBYTECODE=1
for i in 1 2; do
  for side in base branch; do
    echo "== $(date -u +%T) cpu $side $i" >&2
    (cd /tmp/m16/$side && CLIENT=lean PYTHONPATH=/tmp/m16/$side $PY /tmp/m16/cpu_spy.py $OUT/cpu-$side-$i) > $OUT/cpu-$side-$i.txt 2>&1
  done
done
for round in "$@"; do
  for side in base branch; do
    echo "== $(date -u +%T) overhead $side $round" >&2
    (cd /tmp/m16/$side && PYTHONPATH=/tmp/m16/$side $PY -m superinfer.cli bench overhead --requests 32 --repeats 5 --json $OUT/overhead-$side-$round.json) > $OUT/overhead-$side-$round.txt 2> $OUT/overhead-$side-$round.log
  done
done
echo "== $(date -u +%T) done" >&2
