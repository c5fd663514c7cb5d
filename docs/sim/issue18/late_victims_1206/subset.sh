# The cells the three tries were run on (LVF only, seed 0); from the repository root, with
# the try's diff applied: SI_LATE_VICTIMS=1 bash docs/sim/issue18/late_victims_1206/subset.sh OUT (late/, late2/: the
# late and lost forms of late_victims.diff). parked_due_lazy/ ran every must-show cell:
# SI_LAZY_PARKED_DUE=1 bash docs/sim/issue18/lazy_1202/lvf_only.sh OUT (stopped after Mixtral).
O=$1; mkdir -p $O
SIM=".venv/bin/python -m superinfer.sim.cli sim"
BASE="--model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --jobs 2"
ART="--max-num-seqs 16384 --max-batched-tokens 16384"
run() { local name=$1; shift; $SIM "$@" $EXTRA --json "$O/$name.json" > "$O/$name.txt" 2>&1; }
run gh200_96gb_defaults --hardware gh200-96gb $BASE --rps 17,20 --policies lvf
run gh200_defaults --hardware gh200 $BASE --rps 17,20 --policies lvf
run gh200_artifact --hardware gh200 $BASE $ART --rps 17,20 --policies lvf
run mixtral_artifact --hardware gh200 --model mixtral-8x7b --dataset sharegpt --duration 120 --seed 0 --jobs 2 $ART --rps 50,60 --policies lvf
