# From the repository root: the simulator sweep behind policy/vlt.py's note on max_stall
# (gh200-96gb, Qwen2.5-32B, ShareGPT-like, 24 req/s for 60 s, seed 0; ~15 s on 2 cores).
.venv/bin/superinfer sim --hardware gh200-96gb --model qwen2.5-32b --dataset sharegpt --rps 24 \
    --duration 60 --jobs 2 \
    --policies lvf,lvf:stall=0.25:label=lvf-stall-0.25,lvf:stall=1:label=lvf-stall-1,lvf:stall=2:label=lvf-stall-2,swapped-first,waiting-first,fcfs \
    --json docs/sim/issue18/stall_bound/gh200-96gb_24.json > docs/sim/issue18/stall_bound/gh200-96gb_24.txt
