#!/usr/bin/env bash
# /tmp/m16/base: `git archive` of main b125476; /tmp/m16/branch: of this branch (3b8ec03).
# Run as `flock /work/bench.lock THIS ROUND...`; results in /tmp/m16/res (copied to res/).
set -u
PY=/work/wt/metrics/.venv/bin/python
OUT=/tmp/m16/res
export PYTHONDONTWRITEBYTECODE=1
run() { local name=$1 side=$2; shift 2
  echo "== $(date -u +%T) overhead $name" >&2
  (cd /tmp/m16/$side && PYTHONPATH=/tmp/m16/$side $PY -m superinfer.cli bench overhead --requests 32 --repeats 5 "$@" --json $OUT/overhead-$name.json) > $OUT/overhead-$name.txt 2> $OUT/overhead-$name.log; }
run base-2 base
run branch-2 branch
run branch-threads1 branch --threads 1
run branch-3 branch
echo "== $(date -u +%T) done" >&2
