"""`python -m experiments policies` stops its stacks cleanly, however it is run or stopped.

Real processes: the experiment, `superinfer serve` with its four services, `bench serve`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil


def _experiment(out: Path, *extra: str) -> subprocess.Popen[bytes]:
    # Started as a background job of a script is (nohup, `&`): SIGINT ignored, which every
    # child inherits.
    return subprocess.Popen(
        [sys.executable, "-m", "experiments", "policies", "--policies",
         "swapped-first", "--out", str(out), "--max-output-len", "16", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def _left_over(run_dir: Path) -> list[str]:
    """Processes still running out of this run directory (serve and its services)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if str(run_dir) in cmd:
            found.append(cmd)
    return found


def test_a_terminated_experiment_stops_its_stack(tmp_path: Path) -> None:
    proc = _experiment(tmp_path, "--rates", "1", "--num-prompts", "500")
    run_dir = tmp_path / ".run-swapped-first"
    serve_out = run_dir / "serve.out"
    deadline = time.monotonic() + 300
    while not (serve_out.exists() and "is ready" in serve_out.read_text()):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the stack did not start"
        time.sleep(0.5)
    time.sleep(2.0)  # the pass is under way
    proc.send_signal(signal.SIGTERM)  # the experiment's own stop: it stops the stack
    proc.wait(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM
    # serve saw the stop and unwound: while the stop was SIGINT, which a background job
    # ignores, serve was SIGKILLed after 60 s with its services undrained
    assert "stopping" in serve_out.read_text()
    deadline = time.monotonic() + 30  # the services' own exits, after serve's
    while _left_over(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _left_over(run_dir)
    assert not (tmp_path / "results.json").exists()  # nothing claimed from a cut pass
