"""The Fig. 17 cell of tests/test_sim.py (50 req/s, α 0.3) for its three transfer variants:
P99 TBT, TPOT / TTFT / per-gap TBT %, copy seconds on the critical path, rotations.

    .venv/bin/python docs/sim/issue18/lazy_due_1205/fig17_cell.py RPS[,RPS...] [ALPHA]

Run from a checkout's root (its tests/ and packages are the ones imported).
"""

import sys

sys.path.insert(0, ".")
from tests.test_sim import VLLM_STYLE, _findings_run  # noqa: E402

rps = [float(x) for x in sys.argv[1].split(",")]
alpha = sys.argv[2] if len(sys.argv) > 2 else "0.3"
for r in rps:
    for name, v in (("small", f"lvf:alpha={alpha}:{VLLM_STYLE}:xfer=20"),
                    ("large", f"lvf:alpha={alpha}:{VLLM_STYLE}:xfer=400"),
                    ("duplex", f"lvf:alpha={alpha}:xfer=400")):
        res = _findings_run(v, r)
        m = res.metrics
        print(f"rps {r:g} a{alpha} {name:6s} p99tbt {m.p99_tbt_s * 1000:8.1f} ms "
              f"tpot {100 * m.tpot_attainment:5.1f} ttft {100 * m.ttft_attainment:5.1f} "
              f"tbt {100 * m.tbt_attainment:5.1f} xfer {res.stats['transfer_s']:.2f} "
              f"rot {res.stats.get('rotations')}")
