#!/usr/bin/env bash
# Issue #16 step 5: bench experiment, LVF, pipeline on vs --no-pipeline, two rates, alternated.
set -euo pipefail
cd "$(dirname "$0")/../../../.."  # the repository root
for spec in "on 2.4" "off 2.4" "off 3.6" "on 3.6"; do
  set -- $spec
  extra=""; [ "$1" = off ] && extra="--no-pipeline"
  .venv/bin/superinfer bench experiment --policies lvf --rates "$2" --saturation 2.4 \
     --num-prompts 80 --serve-args="$extra" --out "${OUT:-/tmp/pipe_exp}/$1-$2" > "${OUT:-/tmp/pipe_exp}/$1-$2.log" 2>&1
  echo "$1 $2 done $(date +%T)"
done
