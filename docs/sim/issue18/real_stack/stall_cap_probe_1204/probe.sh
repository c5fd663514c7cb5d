# From the repository root, with stall_cap.diff applied (git apply); results went to
# /tmp/runs/probe and were copied here (results.json, table.md, attainment.png, command.txt).
set -x
export SUPERINFER_STALL_CAP=2.5
B=/tmp/runs/probe
.venv/bin/superinfer bench experiment --policies lvf,swapped-first --saturation 2.88 --rates 5.76 --num-prompts 100 --interleave --warmup 8 --seed 1 --out $B/seed1_2x
.venv/bin/superinfer bench experiment --policies lvf,swapped-first --saturation 2.88 --rates 4.32 --num-prompts 100 --interleave --warmup 8 --seed 4 --out $B/seed4_1.5x
