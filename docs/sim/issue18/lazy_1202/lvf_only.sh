#!/bin/bash
# LVF-only runs of every must-show cell (lazy rotation, 2026-12-02), JSON and tables into OUTDIR.
# From the repository root: bash docs/sim/issue18/lazy_1202/lvf_only.sh OUTDIR
# (EXTRA="--flag ...": more sim flags for every run, e.g. EXTRA=--parked-first)
# The baselines do not rotate lazily (their rows are reproduce.sh's); the lvf rows of
# docs/sim/issue18/<name>.json were replaced by these runs' (config.lvf_rows_from).
O=$1; mkdir -p $O
SIM=".venv/bin/python -m superinfer.sim.cli sim"
BASE="--model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --jobs 2"
ART="--max-num-seqs 16384 --max-batched-tokens 16384"
run() { local name=$1; shift; $SIM "$@" $EXTRA --json "$O/$name.json" > "$O/$name.txt" 2>&1; echo "== $name"; grep -A12 "^policy " $O/$name.txt | grep "^lvf " ; }
run gh200_artifact --hardware gh200 $BASE $ART --rps 5,8,11,14,17,20 --policies lvf
run gh200_96gb_defaults --hardware gh200-96gb $BASE --rps 5,8,11,14,17,20 --policies lvf
run gh200_defaults --hardware gh200 $BASE --rps 14,17,20 --policies lvf
run mixtral_artifact --hardware gh200 --model mixtral-8x7b --dataset sharegpt --duration 120 --seed 0 --jobs 2 $ART --rps 30,40,50,60 --policies lvf
run llama3_artifact --hardware gh200 --model llama-3-8b --dataset sharegpt --duration 120 --seed 0 --jobs 2 $ART --rps 40,60 --policies lvf
run llama3_artifact_high --hardware gh200 --model llama-3-8b --dataset sharegpt --duration 120 --seed 0 --jobs 2 $ART --rps 100,140 --policies lvf
run mixed_gh200_artifact --hardware gh200 $BASE $ART --rps 20 --slo-classes mixed --policies lvf
run mixed_gh200_96gb --hardware gh200-96gb $BASE --rps 14,20 --slo-classes mixed --policies lvf
