#!/bin/bash
# GPU cells with the requests' output lengths unknown to the scheduler (`sim --lengths
# unknown`: no max_tokens, EOS at the trace's length), 2026-12-05.
#   PYTHONPATH=. bash docs/sim/issue18/unknown_lengths_1204/gpu/run.sh OUTDIR lvf
# from the root of the checkout to measure (before/: main 21f862c with the sim option
# applied; after/: this change; median_and_baselines/ has the baselines' rows).
O=$1; P=$2; mkdir -p $O
SIM=".venv/bin/python -m superinfer.sim.cli sim"
BASE="--model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --jobs 2 --lengths unknown"
ART="--max-num-seqs 16384 --max-batched-tokens 16384"
run() { local name=$1; shift; $SIM "$@" --json "$O/$name.json" > "$O/$name.txt" 2>&1; echo "== $name"; }
run gh200_artifact --hardware gh200 $BASE $ART --rps 14,17,20 --policies $P
run gh200_96gb_defaults --hardware gh200-96gb $BASE --rps 14,17,20 --policies $P
run mixtral_artifact --hardware gh200 --model mixtral-8x7b --dataset sharegpt --duration 120 --seed 0 --jobs 2 --lengths unknown $ART --rps 40,50 --policies $P
run mixed_gh200_artifact --hardware gh200 $BASE $ART --rps 20 --slo-classes mixed --policies $P
