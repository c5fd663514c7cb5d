cd /work/main
for s in 15 14; do
.venv/bin/superinfer bench experiment --policies lvf,swapped-first,waiting-first --variant "lvf-room0.5=lvf --growth-room 0.5" --saturation 0.57 --rates 0.855 --num-prompts 100 --interleave --warmup 8 --seed $s --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" --out /tmp/room/main_s$s > /tmp/room/s$s.log 2>&1
done
