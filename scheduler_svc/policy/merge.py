"""The policy's sorted candidate runs merged lazily, in its order.

Each queue keeps the policy's groups sorted (policy/base.py); an iteration merges them
instead of sorting every live request, and computes keys only for the candidates the
admission walk consumes (a few hundred of thousands, per iteration).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable, Iterator

from scheduler_svc.queue import Entry
from scheduler_svc.request import Request

_request_of = operator.itemgetter(2)  # of a queue Entry


def merge(
    runs: list[list[Entry]], key: Callable[[Request, float], tuple[object, ...]], now: float
) -> Iterator[Request]:
    """The requests of sorted runs in `key` order, computing keys only for those consumed.

    heapq.merge's order (equal keys: the earlier run first), without its per-item wrappers:
    the admission walk may consume a few hundred candidates per iteration."""
    if len(runs) == 1:  # one group (one SLO class, or a static policy): already in order
        return map(_request_of, runs[0])
    return merge_runs(runs, key, now)


def merge_runs(
    runs: list[list[Entry]], key: Callable[[Request, float], tuple[object, ...]], now: float
) -> Iterator[Request]:
    # A heap of (head's key, run index): the run index breaks ties as in heapq.merge. The
    # top run's entries that still come before the next run's head are yielded without
    # heap operations, and long stretches are found by galloping (keys at +1, +2, +4, ...
    # then a binary search), so a run that leads for many candidates costs O(log) keys.
    # Keys are pure functions of a queued request and `now`, so which ones are computed
    # does not change the order.
    heap = [(key(run[0][2], now), i) for i, run in enumerate(runs) if run]
    heapq.heapify(heap)
    pos = [0] * len(runs)
    while len(heap) > 1:
        i = heap[0][1]
        nxt = heap[1] if len(heap) == 2 or heap[1] < heap[2] else heap[2]
        run, j = runs[i], pos[i]
        n = len(run)
        yield run[j][2]
        j += 1
        if j == n:
            heapq.heappop(heap)
            continue
        head = (key(run[j][2], now), i)
        if head < nxt:  # run i leads on: find where its lead ends
            lo, step = j, 1  # run[lo] comes before nxt
            hi = n  # the first entry that does not (or the end), and its key:
            stop: tuple[tuple[object, ...], int] | None = None
            while True:
                probe = j + step
                if probe >= n:
                    break
                k = (key(run[probe][2], now), i)
                if not k < nxt:
                    hi, stop = probe, k
                    break
                lo, step = probe, step * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                k = (key(run[mid][2], now), i)
                if k < nxt:
                    lo = mid
                else:
                    hi, stop = mid, k
            for e in run[j:hi]:
                yield e[2]
            j = hi
            if stop is None:  # run i is done
                heapq.heappop(heap)
                continue
            head = stop
        pos[i] = j
        heapq.heapreplace(heap, head)
    if heap:  # one run left: the rest of it in order, no keys needed
        i = heap[0][1]
        for e in runs[i][pos[i]:]:
            yield e[2]
