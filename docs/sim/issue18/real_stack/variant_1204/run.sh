#!/usr/bin/env bash
# LVF and LVF variants beside swapped-first and waiting-first at 1.5x the saturation rate,
# one interleaved sweep per seed (a seed's passes share the machine's state), from the
# repository root. Usage: bash run.sh OUTDIR [SEEDS] [RATES]   (~2.5 min per pass)
#   VARIANTS (environment): --variant arguments, default lvf-a1 (--alpha 1) and lvf-pf
#   (--parked-first). Nothing else may run on the machine meanwhile (a niced simulator
#   beside one pass slowed it by 15 %).
set -euo pipefail
out=$1
seeds=${2:-"11 12 13"}
rates=${3:-4.32}
variants=${VARIANTS:-"lvf-a1=lvf --alpha 1|lvf-pf=lvf --parked-first"}
IFS='|' read -ra vs <<< "$variants"
args=()
for v in "${vs[@]}"; do args+=(--variant "$v"); done
for seed in $seeds; do
    .venv/bin/superinfer bench experiment --policies lvf,swapped-first,waiting-first \
        "${args[@]}" --saturation 2.88 --rates "$rates" --num-prompts 100 --interleave \
        --warmup 8 --seed "$seed" --out "$out/s${seed}_${rates//,/_}"
done
