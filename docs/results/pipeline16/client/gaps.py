"""Where the worker idled in a `bench pipeline --keep-traces` trace: the gaps between
consecutive execute spans, the largest ones, and how much of them transfer waits covered.
Run from the checkout: `.venv/bin/python docs/results/pipeline16/client/gaps.py TRACE.json`
(the traces here are gzipped: `gunzip -k` them first).
"""

import statistics
import sys

from scheduler_svc.trace import load_trace
from superinfer.bench.pipeline import covered


def spans(events: list[dict], name: str) -> list[dict]:
    return sorted((e for e in events if e.get("ph") == "X" and e["name"] == name),
                  key=lambda e: e["ts"])


def main(path: str) -> None:
    events = load_trace(path)
    ex, waits = spans(events, "execute"), spans(events, "transfer wait")
    after = spans(events, "after-batch copies")
    start, end = ex[0]["ts"], ex[-1]["ts"] + ex[-1]["dur"]
    wall, compute = (end - start) / 1e6, sum(e["args"]["compute_s"] for e in ex)
    print(f"batches {len(ex)} wall {wall:.3f} s compute {compute:.3f} s "
          f"share {compute / wall:.4f} idle {wall - compute:.3f} s")
    gaps = [((b["ts"] - a["ts"] - a["dur"]) / 1e6, a, b) for a, b in zip(ex, ex[1:])]
    g = sorted(x for x, _, _ in gaps)
    print(f"gap ms: median {1e3 * statistics.median(g):.2f} p90 {1e3 * g[int(0.9 * len(g))]:.2f} "
          f"max {1e3 * g[-1]:.2f}; gaps < 5 ms: {sum(x for x in g if x < 0.005):.3f} s "
          f"in {sum(1 for x in g if x < 0.005)}, >= 5 ms: {sum(x for x in g if x >= 0.005):.3f} s "
          f"in {sum(1 for x in g if x >= 0.005)}")
    held = sum(covered(a["ts"] + a["dur"], b["ts"], waits) for x, a, b in gaps if x > 0)
    print(f"transfer waits: {sum(w['dur'] for w in waits) / 1e6:.3f} s in {len(waits)}, of "
          f"which {held:.3f} s in gaps; after-batch copies: {len(after)}, "
          f"{sum(w['dur'] for w in after) / 1e6:.3f} s")
    for x, a, b in sorted(gaps, key=lambda t: -t[0])[:12]:
        s, e = a["ts"] + a["dur"], b["ts"]
        print(f"gap {1e3 * x:7.2f} ms at {(s - start) / 1e6:5.2f} s: batch {a['args']['iteration']}"
              f" ({a['args']['tokens']} tokens) -> {b['args']['iteration']} "
              f"({b['args']['tokens']} tokens), {1e3 * covered(s, e, waits):.1f} ms in a wait")


if __name__ == "__main__":
    main(sys.argv[1])
