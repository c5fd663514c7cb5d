# bench sched, the change (main at 3c96ac5) and the code before it (a worktree at 217f88d,
# /work/wt, run with its own tree on PYTHONPATH), interleaved three times on a quiet machine.
for i in 1 2 3; do
  cd /work/main && PYTHONPATH=/work/main .venv/bin/superinfer bench sched --json docs/sim/issue18/decision_cost_1206/new$i.json > docs/sim/issue18/decision_cost_1206/new$i.txt 2>&1
  cd /work/wt && PYTHONPATH=/work/wt /work/main/.venv/bin/superinfer bench sched --json /work/main/docs/sim/issue18/decision_cost_1206/old$i.json > /work/main/docs/sim/issue18/decision_cost_1206/old$i.txt 2>&1
done
