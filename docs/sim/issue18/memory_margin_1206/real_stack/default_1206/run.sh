#!/bin/bash
# Real stack at the new default (LVF's --memory-margin 6) in the six (seed, rate) cells the
# margin had not yet been run in, then seed 14 at 2x again; the flags of ../run.sh, LVF at
# its defaults beside the two rotating baselines, interleaved, 100 requests per pass. Run
# from a worktree of the commit measured (dc3eb3f), so that editing main cannot reach the
# services mid-pass: cd /work/wt && PYTHONPATH=/work/wt bash <this file>
D=docs/sim/issue18/memory_margin_1206/real_stack/default_1206
mkdir -p $D
for c in ${CELLS:-15:0.855 15:1.14 12:0.855 14:0.855 11:1.14 13:1.14 14:1.14}; do s=${c%%:*}; r=${c##*:}
/work/main/.venv/bin/superinfer bench experiment --policies lvf,swapped-first,waiting-first \
  --saturation 0.57 --rates $r --num-prompts 100 --interleave --warmup 8 --seed $s \
  --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" \
  --out $D/main_s${s}_$r > $D/s${s}_$r.log 2>&1
done
echo done > $D/ALLDONE
