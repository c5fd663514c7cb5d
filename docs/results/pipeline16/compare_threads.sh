#!/usr/bin/env bash
# bench overhead with one forward thread on both sides (--threads 1): the forward then
# leaves a core to the gateway, scheduler and client. Lean client, then httpx. Run under
# `flock /work/bench.lock`.   compare_threads.sh BRANCH_CHECKOUT OUT_DIR
set -euo pipefail
BRANCH=$1 OUT=$(realpath -m "$2")
source "$(dirname "$0")/side.sh"
side threads1-lean "$BRANCH" overhead --requests 32 --repeats 5 --threads 1
side threads1-httpx "$BRANCH" overhead --requests 32 --repeats 5 --threads 1 --client httpx
