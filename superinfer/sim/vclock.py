"""An asyncio event loop on a simulated clock.

The simulator drives the engine's own step (`scheduler_svc/engine_core.py`) with cost
models as its executor and transfer engine. Those lanes take time with `asyncio.sleep`,
and on this loop sleeping costs no wall time: whenever nothing is ready to run, the clock
jumps to the next timer. Whatever overlap the step has — execution of one iteration beside
the transfers and planning of the next — is then simulated exactly, by the same code that
overlaps them on the real machine.

    clock = VirtualClock()
    with asyncio.Runner(loop_factory=clock.new_loop) as runner:
        runner.run(main())   # asyncio.sleep(5) inside returns at once, clock.t += 5
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class VirtualClock:
    """Simulated seconds; the scheduler's clock and the loop's time() at once."""

    __slots__ = ("t", "_loop")

    def __init__(self, t: float = 0.0) -> None:
        self.t = t
        self._loop: _VirtualLoop | None = None

    def __call__(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        """Jump forward (an idle simulator skipping to the next arrival); never back."""
        if t > self.t:
            self.t = t

    def new_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = _VirtualLoop(self)
        return self._loop


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: a wait for a timer moves the clock to that timer instead."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.loop: _VirtualLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        loop = self.loop
        if timeout is None or loop is None or not loop._scheduled:  # type: ignore[attr-defined]
            raise RuntimeError("simulation deadlock: every task waits and no timer is set")
        # Exactly the next timer's deadline (the loop then runs it: deadline <= time()).
        self.clock.advance_to(loop._scheduled[0]._when)  # type: ignore[attr-defined]
        return []


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        selector = _VirtualSelector(clock)
        super().__init__(selector)
        selector.loop = self
        self._clock = clock

    def time(self) -> float:
        return self._clock.t
