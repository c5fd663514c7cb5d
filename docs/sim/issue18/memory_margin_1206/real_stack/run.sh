#!/bin/bash
# Real stack: LVF at its defaults beside `--memory-margin 6` and the two rotating baselines,
# interleaved, 100 requests per pass (the flags of real_stack/room_1206/run.sh); by default
# at 2x the saturation rate, where the CPU twin said the margin costs TTFT. From the
# repository root: bash docs/sim/issue18/memory_margin_1206/real_stack/run.sh
# (run second with CELLS="11:0.855 13:0.855", 1.5x; the margin was not yet the default)
D=docs/sim/issue18/memory_margin_1206/real_stack
for c in ${CELLS:-14:1.14 12:1.14}; do s=${c%%:*}; r=${c##*:}
.venv/bin/superinfer bench experiment --policies lvf,swapped-first,waiting-first \
  --variant "lvf-mm6=lvf --memory-margin 6" --saturation 0.57 --rates $r --num-prompts 100 \
  --interleave --warmup 8 --seed $s \
  --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" \
  --out $D/main_s${s}_$r > $D/s${s}_$r.log 2>&1
done
echo done > $D/ALLDONE
