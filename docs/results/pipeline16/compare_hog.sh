#!/usr/bin/env bash
# bench pipeline (pipelined step only) beside a competing process (hog.py: busy 30 ms,
# asleep 30 ms, as another session's tests), main then branch. Run under flock.
#   compare_hog.sh MAIN_CHECKOUT BRANCH_CHECKOUT OUT_DIR
set -euo pipefail
MAIN=$1 BRANCH=$2 OUT=$(realpath -m "$3")
source "$(dirname "$0")/side.sh"
python3 "$(dirname "$0")/hog.py" & HOG=$!
trap 'kill $HOG' EXIT
side hog-main "$MAIN" pipeline --requests 32 --device-blocks 200 --repeats 2 --modes pipelined
side hog-branch "$BRANCH" pipeline --requests 32 --device-blocks 200 --repeats 2 --modes pipelined
