#!/usr/bin/env bash
# Issue #18's simulator runs (docs/sim/README.md §10). From the repository root:
#   bash docs/sim/issue18/reproduce.sh            # all (~30 min on 2 busy cores)
#   bash docs/sim/issue18/reproduce.sh art mixed  # some of: art 96 def144 mixtral llama llamahigh mixed tradeoff regime ablation
set -uo pipefail
SIM="${SIM:-.venv/bin/python -m superinfer.sim.cli sim}"
OUT=docs/sim/issue18
JOBS="${JOBS:-2}"
BASE="--model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --jobs $JOBS"
ART="--max-num-seqs 16384 --max-batched-tokens 16384"  # the paper's artifact
POL4=lvf,swapped-first,waiting-first,fcfs
SEL="$*"
want() { [ -z "$SEL" ] || [[ " $SEL " == *" $1 "* ]]; }
run() { local name=$1; shift; echo "== $name"; $SIM "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1; tail -1 "$OUT/$name.txt"; }

want art && run gh200_artifact --hardware gh200 $BASE $ART --rps 5,8,11,14,17,20 --policies $POL4 --plot $OUT/gh200_artifact.png
want 96 && run gh200_96gb_defaults --hardware gh200-96gb $BASE --rps 5,8,11,14,17,20 \
  --policies $POL4,lvf:min_res=1024:label=lvf-res1024 --plot $OUT/gh200_96gb_defaults.png
want def144 && run gh200_defaults --hardware gh200 $BASE --rps 14,17,20 --policies $POL4
want mixtral && run mixtral_artifact --hardware gh200 --model mixtral-8x7b --dataset sharegpt \
  --duration 120 --seed 0 --jobs $JOBS $ART --rps 30,40,50,60 --policies $POL4 --plot $OUT/mixtral_artifact.png
want llama && run llama3_artifact --hardware gh200 --model llama-3-8b --dataset sharegpt \
  --duration 120 --seed 0 --jobs $JOBS $ART --rps 40,60 --policies $POL4
want llamahigh && run llama3_artifact_high --hardware gh200 --model llama-3-8b --dataset sharegpt \
  --duration 120 --seed 0 --jobs $JOBS $ART --rps 100,140 --policies $POL4
want mixed && run mixed_gh200_artifact --hardware gh200 $BASE $ART --rps 20 --slo-classes mixed --policies $POL4
want mixed && run mixed_gh200_96gb --hardware gh200-96gb $BASE --rps 14,20 --slo-classes mixed --policies $POL4
want tradeoff && run tradeoff_96gb --hardware gh200-96gb $BASE --rps 17,20 \
  --policies lvf:alpha=0.1,lvf:label=lvf-alpha0.3,lvf:alpha=1,lvf:alpha=3,lvf:alpha=10,lvf:min_res=128,lvf:min_res=256,lvf:min_res=512,lvf:min_res=1024
want regime && run regime_96gb --hardware gh200-96gb $BASE --rps 20 \
  --policies lvf:alpha=30,lvf:alpha=30:min_res=128,lvf:alpha=100:min_res=256
want regime && run regime_gh200_artifact --hardware gh200 $BASE $ART --rps 20 \
  --policies lvf:alpha=30:min_res=128,lvf:alpha=10:min_res=128,lvf:min_res=128
want ablation && run ablation_gh200_artifact --hardware gh200 $BASE $ART --rps 20 \
  --policies lvf,lvf:tbt_budget=0:label=lvf-no-time-budget,lvf:cost=model:label=lvf-oracle-cost,lvf:prefill=1.0:label=lvf-prefill-within-1,lvf:tbt_budget=1.0:label=lvf-budget-1.0
exit 0
