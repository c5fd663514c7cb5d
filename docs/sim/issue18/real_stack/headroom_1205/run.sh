#!/usr/bin/env bash
# The room-to-grow rule for parked requests coming back into free blocks (2026-12-05): the
# same passes as ../unknown_1205/run.sh (chat, 512-token cap, no ignore_eos, 1.5x and 2x
# of the ~0.57 req/s saturation, 100 requests each), seed 11. main_s11: LVF and
# waiting-first without the rule (30d9631); h1_s11: LVF with it (a worktree of 30d9631
# with the rule behind an environment variable, the same arithmetic as the commit).
#   bash run.sh OUTDIR 11 h1 CHECKOUT   (CHECKOUT: a worktree of the commit that adds the rule)
# then ../unknown_1205/summary.py OUTDIR.
set -euo pipefail
exec bash "$(dirname "$0")/../unknown_1205/run.sh" "$@"
