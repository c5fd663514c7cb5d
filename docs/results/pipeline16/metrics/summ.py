"""Medians of the CPU-per-process runs and the bench overhead lines in /tmp/m16/res."""

import glob
import re
import statistics

R = "/tmp/m16/res"
for side in ("base", "branch"):
    vals: dict[str, list[float]] = {}
    for f in sorted(glob.glob(f"{R}/cpu-{side}-*.txt")):
        for line in open(f):
            m = re.search(r"decode ([\d.]+) tok/s; CPU s: (.*)", line)
            if not m:
                continue
            vals.setdefault("decode tok/s", []).append(float(m[1]))
            for kv in m[2].split(", "):
                k, v = kv.rsplit(" ", 1)
                vals.setdefault(k, []).append(float(v))
    print(side, {k: (round(statistics.median(v), 3), min(v), max(v)) for k, v in vals.items()})
    for f in sorted(glob.glob(f"{R}/overhead-{side}-*.txt")):
        print(f, [x for x in open(f) if "median" in x])
