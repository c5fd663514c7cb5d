"""Who misses TPOT in a `superinfer sim` run: the requests whose mean gap exceeded S_F
against those that met it, by output length, rotations, longest gap and arrival.

    .venv/bin/python docs/sim/issue18/cover1_1204/tpot_misses_probe.py --hardware gh200-96gb \
        --model qwen2.5-32b --dataset sharegpt --duration 120 --seed 0 --rps 20 \
        --policies lvf --jobs 1

(one rate, one policy, --jobs 1: the records are collected in this process.)
"""
import sys, statistics as st
from superinfer import slo_metrics
recs = []
orig = slo_metrics.RequestRecord.from_request.__func__
def fr(cls, req, slo_class=None, now=None):
    r = orig(cls, req, slo_class, now); recs.append(r); return r
slo_metrics.RequestRecord.from_request = classmethod(fr)
from superinfer.sim.cli import main
sys.argv = ['superinfer', 'sim'] + sys.argv[1:]
try:
    main()
except SystemExit:
    pass
miss = [r for r in recs if r.tpot_s() is not None and r.tpot_s() > r.tbt_slo_s]
ok = [r for r in recs if r.tpot_s() is not None and r.tpot_s() <= r.tbt_slo_s]
def desc(rs, name):
    if not rs: return
    n = [len(r.token_times) for r in rs]; rot = [r.rotations for r in rs]
    mg = [max(r.gaps()) for r in rs]; arr = [r.arrival_s for r in rs]
    tp = [r.tpot_s() for r in rs]
    print(f"{name}: {len(rs)} out p50 {st.median(n)} mean {st.mean(n):.0f}; rotations mean {st.mean(rot):.2f} zero {sum(x==0 for x in rot)}; maxgap p50 {st.median(mg):.2f} mean {st.mean(mg):.2f}; arrival p50 {st.median(arr):.1f}; tpot p50 {st.median(tp):.3f}")
desc(miss, 'miss'); desc(ok, 'ok')
import collections
b = collections.Counter(min(len(r.token_times)//50,10)*50 for r in miss)
b2 = collections.Counter(min(len(r.token_times)//50,10)*50 for r in ok)
print('by output len bucket miss/ok:', sorted((k, b[k], b2[k]) for k in set(b)|set(b2)))
ba = collections.Counter(int(r.arrival_s//20)*20 for r in miss); ba2 = collections.Counter(int(r.arrival_s//20)*20 for r in ok)
print('by arrival miss/ok:', sorted((k, ba[k], ba2[k]) for k in set(ba)|set(ba2)))
rb = collections.Counter(min(r.rotations,6) for r in miss); rb2 = collections.Counter(min(r.rotations,6) for r in ok)
print('by rotations miss/ok:', sorted((k, rb[k], rb2[k]) for k in set(rb)|set(rb2)))
