"""CPU seconds per process while the stack serves `bench overhead`'s workload (32 greedy
streams x 64 tokens), two served runs, then the in-process engine twice; with an argument,
py-spy (pip install py-spy) samples the gateway, scheduler and worker into /tmp/prof16.
Run from the checkout under test: `flock /work/bench.lock .venv/bin/python THIS [spy]`.
"""

import argparse
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
prompts = [PROMPTS[i % len(PROMPTS)] for i in range(N)]
os.makedirs("/tmp/prof16", exist_ok=True)
tmp = tempfile.TemporaryDirectory()
sup, url = so._start_stack(Path(tmp.name), 512, 300, scheduler_args=["--no-enable-prefix-caching"])
procs = {c.spec.name: psutil.Process(c.proc.pid) for c in sup.children}
me = psutil.Process()


def cpu() -> dict[str, float]:
    d = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    d["client"] = sum(me.cpu_times()[:2])
    return d


try:
    asyncio.run(so._served_once(url, prompts[:2], 4))
    spy = []
    if len(sys.argv) > 1:
        for n in ("gateway", "scheduler", "worker"):
            spy.append(subprocess.Popen([os.path.dirname(sys.executable) + "/py-spy", "record", "-r", "200", "-f", "raw", "-o", f"/tmp/prof16/{n}.txt", "-p", str(procs[n].pid), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
    for rep in range(2):
        c0, t0 = cpu(), time.monotonic()
        m = asyncio.run(so._served_once(url, prompts, NEW))
        c1, t1 = cpu(), time.monotonic()
        wall = t1 - t0
        print(f"served rep {rep}: wall {wall:.2f}s decode {m.decode_tok_s:.1f} tok/s; CPU s: " +
              ", ".join(f"{k} {c1[k]-c0[k]:.2f}" for k in c1), flush=True)
    for p in spy:
        p.send_signal(2)
        p.wait()
finally:
    sup.stop_all()
args = argparse.Namespace(threads=None, device_blocks=512)
ip = so._InProcess(args)
ip.measure(prompts[:2], 4)
for rep in range(2):
    c0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
    m = ip.measure(prompts, NEW)
    print(f"in-process rep {rep}: wall {time.monotonic()-t0:.2f}s decode {m.decode_tok_s:.1f} tok/s; CPU {sum(me.cpu_times()[:2])-c0:.2f}s", flush=True)
ip.close()
