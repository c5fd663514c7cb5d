cd /work/main
for sr in 11:1.14 12:1.14; do s=${sr%:*}; r=${sr#*:}
.venv/bin/superinfer bench experiment --policies lvf,swapped-first,waiting-first --variant "lvf-room1=lvf --growth-room 1" --saturation 0.57 --rates $r --num-prompts 100 --interleave --warmup 8 --seed $s --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" --out /tmp/room/main_s${s}_$r > /tmp/room/s${s}_$r.log 2>&1
done
