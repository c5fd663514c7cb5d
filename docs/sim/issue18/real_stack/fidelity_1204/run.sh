#!/bin/bash
# The simulator's CPU twin against the real stack (2026-12-04 evening), from the repository root.
# 1. calibrate, then at once a four-policy pass at 1.5x (seed 11), then replay it:
#      bash docs/sim/issue18/real_stack/fidelity_1204/run.sh OUTDIR
# 2. (no arguments) only replay the stored passes on the bundled profile (seconds each).
R=docs/sim/issue18/real_stack
SI=.venv/bin/superinfer
if [ -n "$1" ]; then
  O=$1; mkdir -p $O
  $SI sim calibrate --out $O/cpu-local.json
  $SI bench experiment --policies lvf,fcfs,waiting-first,swapped-first --saturation 2.88 \
      --rates 4.32 --num-prompts 100 --interleave --warmup 8 --seed 11 --out $O/s11_15x
  $SI sim fidelity --hardware $O/cpu-local.json --experiment $O/s11_15x/results.json \
      --json $O/s11_15x_fidelity.json | tee $O/s11_15x_fidelity.txt
  exit
fi
for pair in s11_15x:$R/fidelity_1204/s11_15x def_15x_s10:$R/park_cover_1204/def_15x_s10 \
    def_2x_s10:$R/park_cover_1204/def_2x_s10 seed6_2x_all:$R/more_passes_1204/seed6_2x_all \
    seed7_1.5x_all:$R/more_passes_1204/seed7_1.5x_all; do
  $SI sim fidelity --experiment ${pair#*:}/results.json | sed -n '3,8p;/max |diff|/p'
done
