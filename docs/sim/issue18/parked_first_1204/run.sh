#!/bin/bash
# The must-show cells with LVF's --parked-first (off by default), LVF only, into OUTDIR;
# this folder holds the 2026-12-04 run (tables and JSON). From the repository root:
#   bash docs/sim/issue18/parked_first_1204/run.sh OUTDIR      (about 4 min on 2 cores)
# Compare with the lvf rows of docs/sim/issue18/<name>.json (the default).
EXTRA=--parked-first exec bash docs/sim/issue18/lazy_1202/lvf_only.sh "$1"
