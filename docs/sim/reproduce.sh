#!/usr/bin/env bash
# Every table and figure in docs/sim/README.md. Run from the repository root:
#   bash docs/sim/reproduce.sh            # all experiments (~1 h on 2 busy cores)
#   bash docs/sim/reproduce.sh fig16      # one of: fig16 fig16-96 fig16-96-res256 minres starvation hold-first ablation ablation-xfer xfer vlt pcie whatif whatif-more whatif-pcie
set -uo pipefail
SIM="${SIM:-.venv/bin/python -m superinfer.sim.cli sim}"
OUT=docs/sim
JOBS="${JOBS:-2}"
RATES=5,8,11,14,17,20
BASE="--model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --ttft-slo 5 --tbt-slo 0.1 --jobs $JOBS"
POL4=lvf,swapped-first,waiting-first,fcfs
VLLM="layout=layer-first:duplex=off:eager=0"
want() { [ $# -eq 0 ] || [ -z "${SEL:-}" ] || [[ " $SEL " == *" $1 "* ]]; }
SEL="$*"
run() { local name=$1; shift; echo "== $name"; $SIM "$@" > "$OUT/$name.txt" 2>&1; tail -1 "$OUT/$name.txt"; }

want fig16 && run fig16_gh200 --hardware gh200 $BASE --rps $RATES --policies $POL4 \
  --json $OUT/fig16_gh200.json --plot $OUT/fig16_gh200.png
want fig16-96 && run fig16_gh200_96gb --hardware gh200-96gb $BASE --rps $RATES --policies $POL4 \
  --json $OUT/fig16_gh200_96gb.json --plot $OUT/fig16_gh200_96gb.png
want fig16-96-res256 && run fig16_gh200_96gb_res256 --hardware gh200-96gb $BASE --rps $RATES \
  --policies lvf:min_res=256:label=lvf-res256,$POL4 \
  --json $OUT/fig16_gh200_96gb_res256.json --plot $OUT/fig16_gh200_96gb_res256.png
want minres && run minres --hardware gh200-96gb $BASE --rps 14,17,20 \
  --policies lvf:min_res=8,lvf:min_res=32,lvf:min_res=64,lvf:min_res=128,lvf:min_res=256,lvf:min_res=512,lvf:min_res=1024,lvf:min_res=32:margin=2 \
  --json $OUT/minres.json
want starvation && { echo "== starvation"; .venv/bin/python $OUT/starvation.py \
  --hardware gh200-96gb $BASE --rps 14,20 \
  --policies lvf,lvf:min_res=256:label=lvf-res256,swapped-first,waiting-first,waiting-first:min_res=256:label=wf-res256,fcfs \
  --json $OUT/starvation.json > $OUT/starvation.txt 2>&1; tail -1 $OUT/starvation.txt; }
want ablation && run ablation --hardware gh200-96gb $BASE --rps 8,11,14,17 \
  --policies "swapped-first:$VLLM:label=sf+vllm-offload,lvf:$VLLM:xfer=300:label=lvf+vllm-offload-B300,lvf:$VLLM:xfer=2400:label=lvf+vllm-offload-B2400,lvf:xfer=2400:label=lvf+DuplexKV-B2400,swapped-first:label=sf+DuplexKV" \
  --json $OUT/ablation.json --plot $OUT/ablation.png
want hold-first && { echo "== whatif_hold_first"; .venv/bin/python $OUT/whatif_hold_first.py --starvation \
  --hardware gh200-96gb $BASE --rps 14,20 \
  --policies lvf:label=lvf-hold-first,lvf:min_res=256:label=lvf-res256-hold-first \
  --json $OUT/whatif_hold_first.json > $OUT/whatif_hold_first.txt 2>&1; tail -1 $OUT/whatif_hold_first.txt; }
want ablation-xfer && run ablation_xfer --hardware gh200-96gb $BASE --rps 11,14,17 \
  --policies "swapped-first:$VLLM:label=sf+vllm,lvf:$VLLM:xfer=20:label=lvf+vllm-B20,lvf:$VLLM:xfer=60:label=lvf+vllm-B60,lvf:$VLLM:xfer=150:label=lvf+vllm-B150,lvf:$VLLM:xfer=2400:label=lvf+vllm-B2400,lvf:$VLLM:xfer=60:min_res=256:label=lvf+vllm-B60-r256,lvf:$VLLM:xfer=2400:min_res=256:label=lvf+vllm-B2400-r256" \
  --json $OUT/ablation_xfer.json --plot $OUT/ablation_xfer.png
want xfer && run xfer --hardware gh200-96gb $BASE --rps 14,17,20 \
  --policies lvf:xfer=50,lvf:xfer=150,lvf:xfer=600,lvf:xfer=2400,lvf:xfer=none,lvf:xfer=50:min_res=256,lvf:xfer=150:min_res=256,lvf:xfer=600:min_res=256,lvf:xfer=2400:min_res=256 \
  --json $OUT/xfer.json
want vlt && run vlt --hardware gh200-96gb $BASE --rps 14,20 \
  --policies lvf:alpha=1,lvf:alpha=3:label=lvf-default,lvf:alpha=9,lvf:beta_f=0.2,lvf:beta_f=0.8,lvf:beta_b=0.3,lvf:beta_b=0.6,lvf:min_res=256:alpha=1,lvf:min_res=256:label=r256-default,lvf:min_res=256:alpha=9,lvf:min_res=256:beta_f=0.2,lvf:min_res=256:beta_f=0.8,lvf:min_res=256:beta_b=0.3,lvf:min_res=256:beta_b=0.6 \
  --json $OUT/vlt.json
want pcie && run fig16_h100_pcie --hardware h100-pcie $BASE --rps 2,4,6,8,11,14 --policies $POL4 \
  --json $OUT/fig16_h100_pcie.json --plot $OUT/fig16_h100_pcie.png
want pcie && run fig16_pcie_link --hardware $OUT/gh200-96gb-pcie-link.json $BASE --rps $RATES \
  --policies $POL4 --json $OUT/fig16_pcie_link.json --plot $OUT/fig16_pcie_link.png
# The what-ifs of §6.7: LVF's skip of an unservable candidate is the product now, so the
# "skip" runs are plain `sim` runs and whatif_skip_unservable.py runs the strict stop.
want whatif && run whatif_skip --hardware gh200-96gb $BASE --rps $RATES \
  --policies lvf:label=lvf-skip-unservable --json $OUT/whatif_skip.json --plot $OUT/whatif_skip.png
want whatif && { echo "== whatif_strict"; .venv/bin/python $OUT/whatif_skip_unservable.py \
  --hardware gh200-96gb $BASE --rps $RATES --policies lvf:label=lvf-strict-stop \
  --json $OUT/whatif_strict.json > $OUT/whatif_strict.txt 2>&1; tail -1 $OUT/whatif_strict.txt; }
want whatif-more && run whatif_more --hardware gh200-96gb $BASE --rps 14,17 \
  --policies lvf:alpha=1,lvf:label=lvf-default,lvf:alpha=9,lvf:beta_f=0.2,lvf:beta_f=0.8,lvf:beta_b=0.3,lvf:beta_b=0.6,lvf:xfer=150,lvf:xfer=600,lvf:min_res=8 \
  --json $OUT/whatif_more.json
want whatif-pcie && run whatif_skip_pcie_link --hardware $OUT/gh200-96gb-pcie-link.json $BASE \
  --rps 14,17,20 --policies lvf:label=lvf-skip-unservable --json $OUT/whatif_skip_pcie_link.json
exit 0
