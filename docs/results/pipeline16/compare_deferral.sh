#!/usr/bin/env bash
# After the late swap-in deferral: bench pipeline (main, branch, interleaved; the branch's
# traces to /tmp), then one more bench overhead round. Run under flock /work/bench.lock.
#   compare_deferral.sh MAIN_CHECKOUT BRANCH_CHECKOUT OUT_DIR
set -euo pipefail
MAIN=$1 BRANCH=$2 OUT=$(realpath -m "$3")
source "$(dirname "$0")/side.sh"
side main-2 "$MAIN" pipeline --requests 32 --device-blocks 200 --repeats 2
side deferral "$BRANCH" pipeline --requests 32 --device-blocks 200 --repeats 2 \
  --keep-traces /tmp/prof16/traces-deferral
side main-3 "$MAIN" overhead --requests 32 --repeats 5
side branch-3 "$BRANCH" overhead --requests 32 --repeats 5
