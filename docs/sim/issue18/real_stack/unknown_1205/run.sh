#!/usr/bin/env bash
# The real stack with requests whose length the server does not know (2026-12-05): chat
# requests with a client's cap of 512 tokens and no ignore_eos, so the model's EOS ends
# them (40 probe requests: 18 ended by EOS at 13-191 tokens, 22 ran to the cap; mean 308,
# ~175 tok/s with all in flight: saturation ~0.57 req/s). 1.5x and 2x, 100 requests each.
#   bash run.sh OUTDIR SEED                    LVF, swapped-first, waiting-first from this
#                                              checkout, interleaved: OUTDIR/main_sSEED
#   bash run.sh OUTDIR SEED LABEL CHECKOUT     LVF alone from another checkout (a git
#                                              worktree): OUTDIR/LABEL_sSEED
# Run from the repository root. Another checkout runs with it as the working directory
# (python -m puts the working directory first on sys.path; PYTHONPATH does not override
# the editable install) and this checkout's .venv. Then summary.py OUTDIR.
set -euo pipefail
out=$(realpath -m "$1"); seed=$2; label=${3:-main}; checkout=${4:-.}
py="$PWD/.venv/bin/python"  # (realpath would resolve the venv's link away)
policies=lvf
[ "$label" = main ] && policies=lvf,swapped-first,waiting-first
cd "$checkout"
"$py" -m superinfer.cli bench experiment --policies "$policies" --saturation 0.57 \
    --rates 0.855,1.14 --num-prompts 100 --interleave --warmup 8 --seed "$seed" \
    --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" --out "$out/${label}_s$seed"
