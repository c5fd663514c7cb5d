#!/usr/bin/env bash
# More bench overhead rounds, main (httpx client) then branch (lean client), interleaved.
# Run under `flock /work/bench.lock`.
#   compare_overhead.sh MAIN_CHECKOUT BRANCH_CHECKOUT OUT_DIR ROUND...
set -euo pipefail
MAIN=$1 BRANCH=$2 OUT=$(realpath -m "$3")
shift 3
source "$(dirname "$0")/side.sh"
for round in "$@"; do
  side "main-$round" "$MAIN" overhead --requests 32 --repeats 5
  side "branch-$round" "$BRANCH" overhead --requests 32 --repeats 5
done
