cd /work/wt
export PYTHONPATH=/work/wt
for c in 14:1.14 11:0.855 13:0.855; do s=${c%%:*}; r=${c##*:}
/work/main/.venv/bin/superinfer bench experiment --policies lvf,swapped-first,waiting-first --saturation 0.57 --rates $r --num-prompts 100 --interleave --warmup 8 --seed $s --bench-args "--endpoint chat --no-ignore-eos --max-tokens 512" --out docs/sim/issue18/real_stack/room_1206/main_s${s}_$r > docs/sim/issue18/real_stack/room_1206/s${s}_$r.log 2>&1
done
echo done > docs/sim/issue18/real_stack/room_1206/ALLDONE
