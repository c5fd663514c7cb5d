#!/usr/bin/env bash
# The lean bench client and the measured-run window (branch pipe16b) vs main, interleaved
# on the same machine. Run under `flock /work/bench.lock`. The server code is the same on
# both sides: what differs is the benchmarks' client (lean vs httpx) and bench pipeline's
# window; `branch-httpx` runs the branch with main's client, to tell the two apart.
#   compare_client.sh MAIN_CHECKOUT BRANCH_CHECKOUT OUT_DIR
set -euo pipefail
MAIN=$1 BRANCH=$2 OUT=$(realpath -m "$3")
source "$(dirname "$0")/side.sh"
side main-1 "$MAIN" overhead --requests 32 --repeats 5
side branch-1 "$BRANCH" overhead --requests 32 --repeats 5
side main "$MAIN" pipeline --requests 32 --device-blocks 200 --repeats 2
side branch "$BRANCH" pipeline --requests 32 --device-blocks 200 --repeats 2
side branch-httpx "$BRANCH" pipeline --requests 32 --device-blocks 200 --repeats 2 --client httpx
side main-2 "$MAIN" overhead --requests 32 --repeats 5
side branch-2 "$BRANCH" overhead --requests 32 --repeats 5
