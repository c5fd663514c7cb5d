#!/usr/bin/env bash
# old rule (main 3f44b50, /work/wt/prefix) vs the catch-up rule (/work/main), lvf only, warm, interleaved ABBA
set -x
OUT=/work/main/docs/sim/issue18/real_stack/ab_catch_up
mkdir -p $OUT
one() { # side dir rate
  (cd $2 && flock /work/bench.lock .venv/bin/python -m superinfer.cli bench experiment --policies lvf --rates $3 --num-prompts 100 --warmup 32 --out $OUT/$1@$3 > $OUT/$1@$3.log 2>&1)
}
one old /work/wt/prefix 3.39; one new /work/main 3.39
one new /work/main 4.52; one old /work/wt/prefix 4.52
