"""An insertion-ordered set of requests with O(1) append, remove and membership, and
optionally the policy's groups kept sorted (O(log n) append and remove), and the
smallest request's size.

The scheduler's waiting/running/rotary queues hold thousands of requests under load;
list.remove would make every state change O(n), and sorting every queue every iteration
would make each decision O(n log n). With an `order` function (a policy's `order_key`),
the queue files each request under its group in static-key order, and `groups()` hands
out those sorted runs for the scheduler to merge lazily (policy/base.py).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from scheduler_svc.request import Request

OrderFn = Callable[[Request], tuple[Hashable, tuple[Any, ...]]]
# (static key, insertion number, request): the number keeps entries distinct, so two
# entries never compare their requests.
Entry = tuple[tuple[Any, ...], int, Request]


class RequestQueue:
    __slots__ = ("_items", "_order", "_groups", "_entries", "_seq", "_sizes", "_size_seq", "_live")

    def __init__(self, order: OrderFn | None = None) -> None:
        self._items: dict[str, Request] = {}
        self._order = order
        self._groups: dict[Hashable, list[Entry]] = {}
        self._entries: dict[str, tuple[Hashable, Entry]] = {}
        self._seq = itertools.count()
        # Heap of (num_tokens, n) with lazy deletion: `_size_seq[request_id]` is the live n.
        # Queued requests' token counts do not change (only running ones get tokens).
        self._sizes: list[tuple[int, int]] = []
        self._size_seq: dict[str, int] = {}
        self._live: set[int] = set()

    def append(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._items:
            self.remove(self._items[rid])
        self._items[rid] = req
        n = next(self._seq)
        heapq.heappush(self._sizes, (req.num_tokens, n))
        self._size_seq[rid] = n
        self._live.add(n)
        if self._order is not None:
            group, key = self._order(req)
            entry = (key, n, req)
            bisect.insort(self._groups.setdefault(group, []), entry)
            self._entries[rid] = (group, entry)

    def refile(self) -> None:
        """Re-file every request under its current order key (the policy's keys changed)."""
        reqs = list(self._items.values())
        for req in reqs:
            self.remove(req)
        for req in reqs:
            self.append(req)

    def remove(self, req: Request) -> None:
        del self._items[req.request_id]
        self._live.discard(self._size_seq.pop(req.request_id))
        if self._order is not None:
            group, entry = self._entries.pop(req.request_id)
            run = self._groups[group]
            i = bisect.bisect_left(run, entry)
            if run[i] is not entry:
                raise RuntimeError(
                    f"request {req.request_id} moved in its queue order while queued "
                    "(its order key changed): the queue is corrupt"
                )
            del run[i]
            if not run:
                del self._groups[group]

    def discard(self, req: Request) -> None:
        if self._items.get(req.request_id) is req:
            self.remove(req)

    def min_tokens(self) -> int | None:
        """Token count of the smallest queued request (None when empty)."""
        sizes, live = self._sizes, self._live
        if len(sizes) > 2 * len(live) + 64:  # mostly dead entries: rebuild from the live ones
            self._sizes = sizes = [(r.num_tokens, self._size_seq[r.request_id])
                                   for r in self._items.values()]
            heapq.heapify(sizes)
        while sizes and sizes[0][1] not in live:
            heapq.heappop(sizes)
        return sizes[0][0] if sizes else None

    def groups(self) -> list[list[Entry]]:
        """Snapshots of the sorted groups (safe to hold while the queue changes)."""
        return [run.copy() for run in self._groups.values()]

    def live_groups(self) -> list[list[Entry]]:
        """The sorted groups themselves, to read before the queue next changes (no copy of
        thousands of entries for a look that changes nothing)."""
        return list(self._groups.values())

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and self._items.get(req.request_id) is req

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def list(self) -> list[Request]:
        return list(self._items.values())
