"""Iteration timeline as a Chrome / Perfetto trace (`--trace PATH`).

Open the file in https://ui.perfetto.dev or chrome://tracing. One process, tracks:

* `schedule` — the scheduler's decision (`Scheduler.schedule()`), one span per iteration
  with the batch in its args (chunks, prefill/decode tokens, rotations, blocks moved);
* `transfer D2H` and `transfer H2D` — the iteration's block copies per direction, as the
  transfer engine timed them (each lane's busy time, drawn from the start of the
  iteration's transfer: both lanes start together in duplex mode; in the one-direction
  modes the H2D lane really starts after D2H, so there the spans overlap more than the
  copies did). A `transfer wait` span on the same row spans the whole wait, RPC included;
* `execute` — the worker's forward pass (its compute time, drawn where its output landed;
  the span's `compute_s` argument), one batch after another; with the pipelined step the
  schedule and transfer spans of the next iteration overlap it;
* counters: running / waiting / rotary requests and free device / host blocks;
* one async track per request: its waiting / running / rotary intervals, written when the
  request finishes (so a request still live when the trace closes is not in it).

Events are written as they happen, one JSON object per line inside a JSON array, and
flushed at least once a second while busy and whenever the loop goes idle: a process that dies leaves a trace without the closing
bracket, which both viewers accept (and `load_trace` reads).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from common.contracts import TransferPlan
from scheduler_svc.interfaces import SchedulerOutput
from scheduler_svc.request import Request

TRACKS = {"schedule": 1, "transfer D2H": 2, "transfer H2D": 3, "execute": 4}


class Trace:
    def __init__(self, path: str | Path, process_name: str = "superinfer",
                 clock: Callable[[], float] = time.monotonic, flush_s: float = 1.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._f.write("[\n")
        self._first = True
        self._flush_s = flush_s
        self._flushed = time.monotonic()
        self._lock = threading.Lock()
        self.clock = clock
        self.t0 = clock()  # trace time 0, on the scheduler's clock
        # clock_origin_s: trace time 0 on that clock (time.monotonic() by default, which is
        # system-wide), so another process can place its own moments on the timeline.
        self._emit({"ph": "M", "name": "process_name", "pid": 1,
                    "args": {"name": process_name, "clock_origin_s": self.t0}})
        for name, tid in TRACKS.items():
            self._emit({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                        "args": {"name": name}})
            self._emit({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                        "args": {"sort_index": tid}})

    # -- writing ----------------------------------------------------------------------------
    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def _emit(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._f is None:
                return
            self._f.write(("" if self._first else ",\n") + json.dumps(event, default=str))
            self._first = False
            now = time.monotonic()
            if now - self._flushed >= self._flush_s:
                self._f.flush()
                self._flushed = now

    def span(self, track: str, name: str, start: float, dur_s: float,
             args: dict[str, Any] | None = None) -> None:
        """A complete span on one of TRACKS; `start` on the scheduler's clock."""
        ev: dict[str, Any] = {"ph": "X", "pid": 1, "tid": TRACKS[track], "name": name,
                              "ts": self._us(start), "dur": round(max(dur_s, 0.0) * 1e6, 1)}
        if args:
            ev["args"] = args
        self._emit(ev)

    def counters(self, at: float, **values: float) -> None:
        self._emit({"ph": "C", "pid": 1, "name": "load", "ts": self._us(at), "args": values})

    # -- what the loops call --------------------------------------------------------------------
    def iteration(
        self,
        out: SchedulerOutput,
        start: float,
        *,
        transfer: tuple[float, float] | None = None,
        d2h_s: float = 0.0,
        h2d_s: float = 0.0,
        execute: tuple[float, float] | None = None,
        execute_s: float | None = None,
        executed: SchedulerOutput | None = None,
        load: dict[str, float] | None = None,
    ) -> None:
        """One iteration: `start` = when schedule() began; (start, seconds) pairs for the
        transfer wait and the execute call, all on the scheduler's clock. `executed`: the
        iteration whose batch the execute span is (pipelined: the one before `out`)."""
        plan = out.transfers
        self.span("schedule", f"iteration {out.iteration}", start, out.decision_s, {
            "chunks": len(out.chunks), "prefill_tokens": out.num_prefill_tokens,
            "decode_tokens": out.num_decode_tokens, "rotated_out": len(out.rotated_out),
            "rotated_in": len(out.rotated_in), "recomputed": len(out.recomputed),
            "swap_out_blocks": len(plan.swap_out) if plan else 0,
            "swap_in_blocks": len(plan.swap_in) if plan else 0,
            "eager_blocks": len(plan.eager) if plan else 0,
        })
        if transfer is not None and plan is not None:
            t, dur = transfer
            self.span("transfer D2H", "transfer wait", t, dur, {"fence": plan.fence})
            if d2h_s > 0:
                self.span("transfer D2H", "D2H", t, d2h_s, {
                    "swap_out_blocks": len(plan.swap_out), "eager_blocks": len(plan.eager)})
            if h2d_s > 0:
                self.span("transfer H2D", "H2D", t, h2d_s,
                          {"swap_in_blocks": len(plan.swap_in)})
        if execute is not None:
            t, dur = execute
            ran = executed or out
            args: dict[str, Any] = {"iteration": ran.iteration, "tokens": ran.num_tokens}
            if execute_s is not None:
                args["compute_s"] = round(execute_s, 6)
            self.span("execute", "execute", t, dur, args)
        if load:
            self.counters(start, **load)

    def copies(self, plan: TransferPlan, start: float, dur_s: float, d2h_s: float,
               h2d_s: float) -> None:
        """Copies that ran beside a batch (the pipelined step's eager and after-batch
        copies)."""
        what = "after-batch copies" if plan.swap_out or plan.swap_in else "eager copies"
        self.span("transfer D2H", what, start, dur_s, {"fence": plan.fence})
        if d2h_s > 0:
            self.span("transfer D2H", "D2H", start, d2h_s,
                      {"swap_out_blocks": len(plan.swap_out), "eager_blocks": len(plan.eager)})
        if h2d_s > 0:
            self.span("transfer H2D", "H2D", start, h2d_s, {"swap_in_blocks": len(plan.swap_in)})

    def request_done(self, req: Request, now: float) -> None:
        """The request's state intervals as async spans on its own track."""
        spans = [*req.transitions, (now, "end")]
        for (t, state), (t_next, _) in zip(spans, spans[1:], strict=False):
            if state == "finished":
                break
            base = {"pid": 1, "cat": "request", "id": req.request_id, "name": state}
            self._emit({**base, "ph": "b", "ts": self._us(t),
                        "args": {"request_id": req.request_id}})
            self._emit({**base, "ph": "e", "ts": self._us(t_next)})

    def flush(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.flush()
                self._flushed = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._f is None:
                return
            self._f.write("\n]\n")
            self._f.close()
            self._f = None


def clock_origin(events: list[dict[str, Any]]) -> float | None:
    """Trace time 0 on the scheduler's clock (None: a trace written before it was kept)."""
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            origin = e.get("args", {}).get("clock_origin_s")
            return float(origin) if origin is not None else None
    return None


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """Read a trace back, closed or not (a killed process leaves no closing bracket)."""
    text = Path(path).read_text(encoding="utf-8").rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "\n]"
    events: list[dict[str, Any]] = json.loads(text)
    return events
