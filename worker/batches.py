"""The worker's batches, one at a time, in the order the scheduler planned them.

The pipelined step sends batch t+1 before batch t's output reaches the scheduler, so a
decode in t+1 may carry `PLACEHOLDER` as its last token: the token this worker sampled for
that request in t. `BatchRunner` runs every batch on one thread (`common/lane.py`: a
cancelled RPC never lets a second forward, or a pool handle, run beside one still
writing), waits for the batch a placeholder refers to, and fills the placeholder in. It
keeps only the last batch's samples, so a restarted worker needs nothing but what the
scheduler sends: a batch that refers to a batch this process never ran is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace

from common.contracts import PLACEHOLDER, ExecuteResult, ScheduledChunk
from common.lane import ThreadLane

WAIT_FOR_PREVIOUS_S = 30.0  # a batch waits this long for the one it follows to arrive


class OutOfOrder(RuntimeError):
    """A batch refers to a batch this worker has not run (it restarted, or that one failed)."""


class BatchRunner:
    def __init__(self, execute: Callable[[list[ScheduledChunk]], ExecuteResult],
                 release: Callable[[Sequence[str]], None] | None = None) -> None:
        self._execute = execute
        self._release = release  # drops finished requests' sampling state, in batch order
        self._lane = ThreadLane("forward")
        self._submitted = 0  # the last batch handed to the lane (event-loop side)
        self._arrived: asyncio.Condition | None = None
        self._ran = 0  # the last batch that ran to its end (lane side)
        self._sampled: dict[str, int] = {}  # ... and what it sampled

    async def run(self, iteration: int, after: int, chunks: list[ScheduledChunk],
                  released: Sequence[str] = ()) -> ExecuteResult:
        """Run the batch of `iteration` once the batch of `after` (0: none) is queued."""
        if self._arrived is None:
            self._arrived = asyncio.Condition()
        if after and self._submitted < after:
            # Sent one after the other, they may still arrive out of order: wait for it.
            async with self._arrived:
                try:
                    await asyncio.wait_for(
                        self._arrived.wait_for(lambda: self._submitted >= after),
                        WAIT_FOR_PREVIOUS_S)
                except TimeoutError:
                    raise OutOfOrder(f"batch {iteration} follows batch {after}, which never "
                                     "came to this worker") from None
        self._submitted = max(self._submitted, iteration)
        async with self._arrived:
            self._arrived.notify_all()
        return await self._lane.run(self._run, after, chunks, iteration, released)

    async def barrier(self) -> None:
        """Every batch submitted so far has finished writing the pool."""
        await self._lane.barrier()

    def _run(self, after: int, chunks: list[ScheduledChunk], iteration: int,
             released: Sequence[str]) -> ExecuteResult:
        if released and self._release is not None:
            self._release(released)
        chunks = self._fill_placeholders(after, chunks)
        result = self._execute(chunks)
        sampled = result.sampled
        if result.accepted:  # a placeholder stands for a request's last token
            sampled = {**sampled, **{r: t[-1] for r, t in result.accepted.items()}}
        self._ran, self._sampled = iteration, sampled
        return result

    def _fill_placeholders(self, after: int, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        if not any(c.token_ids and c.token_ids[-1] == PLACEHOLDER for c in chunks):
            return chunks
        if after != self._ran:
            raise OutOfOrder(f"a batch carries tokens batch {after} sampled, but the last batch "
                             f"this worker ran is {self._ran or 'none'}")
        out = []
        for c in chunks:
            if c.token_ids and c.token_ids[-1] == PLACEHOLDER:
                tok = self._sampled.get(c.request_id)
                if tok is None:
                    raise OutOfOrder(f"{c.request_id}: batch {after} sampled no token for it")
                c = replace(c, token_ids=[*c.token_ids[:-1], tok])
            out.append(c)
        return out

    def close(self) -> None:
        self._lane.close()
