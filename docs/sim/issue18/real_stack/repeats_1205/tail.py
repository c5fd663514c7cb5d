"""Each pass's tail: how long it ran past its last arrival, and how many requests were
still unfinished then (the makespan vLLM's goodput divides by).

    .venv/bin/python docs/sim/issue18/real_stack/repeats_1205/tail.py PASS.json[.gz] ...
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path


def tail(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    r = json.loads(raw)["results"][0]
    reqs = r["per_request"]
    last_sent = max(p["sent_s"] for p in reqs)
    ends = sorted(p["sent_s"] + p["e2el_s"] for p in reqs)
    left = sum(1 for e in ends if e > last_sent)
    name = f"{path.parent.name}/{path.name}"
    return (f"{name:<46} good {r['good_requests']:>3}  goodput {r['goodput_rps']:.3f}  "
            f"last arrival {last_sent:6.1f} s  last finish {ends[-1]:6.1f} s  "
            f"tail {ends[-1] - last_sent:5.1f} s  unfinished at the last arrival {left:>3}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(tail(Path(arg)))
