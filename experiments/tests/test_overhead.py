"""`python -m experiments overhead`: its per-process CPU meter."""

from __future__ import annotations

import subprocess
import sys


def test_cpu_meter_charges_the_process_that_burned_the_cpu() -> None:
    """The overhead study's per-process CPU (superinfer/bench/proc_cpu.py): a process that
    spins for 0.3 CPU-seconds is charged about that, one that waits almost nothing, and a
    process that is gone reads None."""
    from experiments.proc_cpu import CPUMeter, cpu_seconds

    spin = ("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
            "print('done', flush=True)\nsys.stdin.readline()\n")
    wait = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for code in (spin, wait)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        meter = CPUMeter({"spin": procs[0].pid, "wait": procs[1].pid})
        meter.start()
        busy = procs[0]
        assert busy.stdin is not None and busy.stdout is not None
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline() == "done\n"
        used = meter.stop()
        assert 0.25 <= used["spin"] < 2.0 and used["wait"] < 0.05
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert cpu_seconds(procs[0].pid) is None
