"""CPU seconds of processes, read from /proc (Linux): what each one burned during a run.

On a machine with as few cores as this one the served side's control plane (gateway,
scheduler, kvmem, the client) takes its CPU from the forward's threads, so a benchmark
that compares the served path with the in-process engine reports where that CPU went.
"""

from __future__ import annotations

import os

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of every thread of process `pid` so far (None: gone, or
    no /proc here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: count fields after its closing paren.
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14, 15)


class CPUMeter:
    """CPU seconds per named process between `start()` and `stop()`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._t0: dict[str, float | None] = {}

    def start(self) -> None:
        self._t0 = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            t0, t1 = self._t0.get(name), cpu_seconds(pid)
            if t0 is not None and t1 is not None:
                out[name] = t1 - t0
        return out
