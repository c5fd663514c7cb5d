"""CPU seconds per process (and each one's kernel share, NAME_sys) while the stack serves
bench overhead's workload (32 greedy streams x 64 tokens), two runs with the client named by CLIENT (lean or httpx); with a
second argument, py-spy samples the gateway, scheduler, worker and this client during two
more runs into OUT_DIR/NAME.txt (raw format). Run from the checkout under test:
`CLIENT=lean flock /work/bench.lock .venv/bin/python THIS OUT_DIR [spy]`.
"""

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from superinfer.bench import serve_overhead as so
from superinfer.bench.engine import PROMPTS

N, NEW = 32, 64
CLIENT = os.environ.get("CLIENT", "lean")
OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
prompts = [PROMPTS[i % len(PROMPTS)] for i in range(N)]
tmp = tempfile.TemporaryDirectory()
sup, url = so._start_stack(Path(tmp.name), 512, 300, scheduler_args=["--no-enable-prefix-caching"])
procs = {c.spec.name: psutil.Process(c.proc.pid) for c in sup.children}
me = psutil.Process()


def cpu() -> dict[str, float]:
    d = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    d.update({n + "_sys": p.cpu_times()[1] for n, p in procs.items()})  # kernel time alone
    d["client"] = sum(me.cpu_times()[:2])
    return d


try:
    asyncio.run(so._served_once(url, prompts[:2], 4, CLIENT))
    for rep in range(2):
        c0, t0 = cpu(), time.monotonic()
        m = asyncio.run(so._served_once(url, prompts, NEW, CLIENT))
        c1 = cpu()
        print(f"{CLIENT} rep {rep}: wall {time.monotonic() - t0:.2f} s, decode "
              f"{m.decode_tok_s:.1f} tok/s; CPU s: "
              + ", ".join(f"{k} {c1[k] - c0[k]:.3f}" for k in c1), flush=True)
    if len(sys.argv) > 2:
        spy_bin = os.path.dirname(sys.executable) + "/py-spy"
        targets = [(n, procs[n].pid) for n in ("gateway", "scheduler", "worker")]
        spies = [subprocess.Popen([spy_bin, "record", "-r", "250", "-f", "raw", "-o",
                                   f"{OUT}/{n}.txt", "-p", str(pid), "--nonblocking"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for n, pid in [*targets, ("client", os.getpid())]]
        time.sleep(1)
        for _ in range(2):
            asyncio.run(so._served_once(url, prompts, NEW, CLIENT))
        for p in spies:
            p.send_signal(2)
            p.wait()
finally:
    sup.stop_all()
