"""An insertion-ordered set of requests with O(1) append, remove and membership.

The scheduler's waiting/running/rotary queues hold thousands of requests under load;
list.remove would make every state change O(n).
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler_svc.request import Request


class RequestQueue:
    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: dict[str, Request] = {}

    def append(self, req: Request) -> None:
        self._items[req.request_id] = req

    def remove(self, req: Request) -> None:
        del self._items[req.request_id]

    def discard(self, req: Request) -> None:
        self._items.pop(req.request_id, None)

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
