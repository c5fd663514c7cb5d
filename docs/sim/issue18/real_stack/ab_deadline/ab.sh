#!/usr/bin/env bash
# catch-up rule (main b125476, /work/main) vs deadlines for running requests too (this
# branch, /work/wt/lvf): lvf only, warm stacks, interleaved ABBA, 100 requests per pass
set -x
OUT=/work/wt/lvf/docs/sim/issue18/real_stack/ab_deadline
one() { # side dir rate
  (cd $2 && flock /work/bench.lock .venv/bin/python -m superinfer.cli bench experiment --policies lvf --rates $3 --num-prompts 100 --warmup 32 --out $OUT/$1@$3 > $OUT/$1@$3.log 2>&1)
}
one old /work/main 3.39; one new /work/wt/lvf 3.39
one new /work/wt/lvf 4.52; one old /work/main 4.52
