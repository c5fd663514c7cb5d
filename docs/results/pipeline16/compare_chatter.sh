#!/usr/bin/env bash
# Before (main: one TokenEvent per request per token) vs after (this branch: one TokenBatch
# per iteration on one Subscribe stream), interleaved on the same machine. Run under
# `flock /work/bench.lock`. Each side runs from its own checkout (python -m resolves the
# services' modules from the working directory).
#   compare_chatter.sh MAIN_CHECKOUT BRANCH_CHECKOUT OUT_DIR
set -euo pipefail
MAIN=$1 BRANCH=$2 OUT=$(realpath -m "$3")
source "$(dirname "$0")/side.sh"
for round in 1 2; do
  side "main-$round" "$MAIN" overhead --requests 32 --repeats 5
  side "branch-$round" "$BRANCH" overhead --requests 32 --repeats 5
done
side main "$MAIN" pipeline --requests 32 --device-blocks 200 --repeats 2
side branch "$BRANCH" pipeline --requests 32 --device-blocks 200 --repeats 2
