#!/bin/bash
# the real stack's bench-experiment settings on a calibrated cpu profile (x1.9 serving factor)
cd "$(dirname "$0")/../../../../.."
SEED=${SEED:-0}
.venv/bin/python -m superinfer.sim.cli sim --hardware docs/sim/issue18/real_stack/fidelity_1202/cpu_profile_x1.9.json --model smollm2-135m \
  --dataset sharegpt --num-prompts ${N:-200} --seed $SEED --max-prompt-len 384 --max-output-len 64 \
  --device-blocks 64 --host-blocks 4096 --max-num-seqs 32 --ttft-slo 10 --tbt-slo 0.3 \
  --rps ${RPS:-0.546,0.728} --jobs 2 "$@"
