#!/bin/bash
# LVF with --park-cover on every must-show cell, seeds 0 and 1 (2026-12-04), into OUTDIR.
# From the repository root: bash docs/sim/issue18/park_cover_1204/run.sh OUTDIR  (~16 min)
# Score against the stored baselines: .venv/bin/python docs/sim/issue18/alpha_1204/score.py OUTDIR/*
O=$1; mkdir -p $O
L=docs/sim/issue18/lazy_1202/lvf_only.sh
EXTRA="--park-cover 1" bash $L $O/cover1
EXTRA="--park-cover 2" bash $L $O/cover2
EXTRA="--seed 1" bash $L $O/seed1_default
EXTRA="--seed 1 --park-cover 1" bash $L $O/seed1_cover1
