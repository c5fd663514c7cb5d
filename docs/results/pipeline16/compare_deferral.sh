#!/usr/bin/env bash
# After the late swap-in deferral: bench pipeline (main, branch, interleaved; the branch's
# traces to /tmp), then one more bench overhead round. Run under flock /work/bench.lock.
#   compare_deferral.sh MAIN_CHECKOUT BRANCH_CHECKOUT OUT_DIR
set -euo pipefail
MAIN=$1 BRANCH=$2 OUT=$(realpath -m "$3")
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1
side() {  # side NAME CHECKOUT BENCH ARGS...
  local name=$1 dir=$2 bench=$3; shift 3
  echo "== $(date -u +%H:%M:%S) $bench $name" >&2
  (cd "$dir" && .venv/bin/superinfer bench "$bench" "$@" --json "$OUT/$bench-$name.json") \
    > "$OUT/$bench-$name.txt" 2> "$OUT/$bench-$name.log"
}
side main-2 "$MAIN" pipeline --requests 32 --device-blocks 200 --repeats 2
side deferral "$BRANCH" pipeline --requests 32 --device-blocks 200 --repeats 2 \
  --keep-traces /tmp/prof16/traces-deferral
side main-3 "$MAIN" overhead --requests 32 --repeats 5
side branch-3 "$BRANCH" overhead --requests 32 --repeats 5
