"""One thread that runs a service's blocking work in order, whatever happens to the caller.

The worker's forward passes and kvmem's copies write shared memory from a thread while an
asyncio handler awaits them. If the handler is cancelled (a deadline, a client gone), the
await ends but the thread's work does not; a lock held by the handler would be released
while the pool is still being written, and the next forward, copy or pool handle could run
beside it. A `ThreadLane` runs every job on its one thread, first come first served, and a
cancelled caller only stops waiting: the job runs to its end before the lane starts the
next, and `barrier()` returns only once everything submitted before it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ThreadLane:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the lane's thread after everything submitted before it."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        # Shielded: cancelling the caller must not look like the job stopped.
        return await asyncio.shield(fut)

    async def barrier(self) -> None:
        """Wait until every job submitted so far has finished (cancelled callers' too)."""
        await self.run(lambda: None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
