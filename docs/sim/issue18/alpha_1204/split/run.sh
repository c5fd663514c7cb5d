#!/bin/bash
# The preemption split (for new / for parked / growth) of every policy at the must-show
# cells where LVF fails, defaults. From the repository root:
#   bash docs/sim/issue18/alpha_1204/split/run.sh OUTDIR
O=$1; mkdir -p $O
SIM=".venv/bin/python -m superinfer.sim.cli sim"
BASE="--dataset sharegpt --duration 120 --seed 0 --jobs 2 --policies lvf,swapped-first,waiting-first,fcfs"
ART="--max-num-seqs 16384 --max-batched-tokens 16384"
run() { local name=$1; shift; $SIM "$@" --json "$O/$name.json" > "$O/$name.txt" 2>&1; echo "== $name"; sed -n '/^why running/,/^$/p' "$O/$name.txt"; }
run gh200_96gb_defaults_20 --hardware gh200-96gb --model qwen2.5-32b $BASE --rps 20
run gh200_defaults_20 --hardware gh200 --model qwen2.5-32b $BASE --rps 20
run gh200_artifact_20 --hardware gh200 --model qwen2.5-32b $BASE $ART --rps 20
run mixtral_artifact_50_60 --hardware gh200 --model mixtral-8x7b $BASE $ART --rps 50,60
run llama3_artifact_140 --hardware gh200 --model llama-3-8b $BASE $ART --rps 140
