"""What bounds the gateway's memory: requests in flight and the size of each body.

Every request the gateway holds costs its body, its parsed form, its token ids and a
stream; both numbers are bounded so that a flood of clients meets a 429 or a 413 instead
of growing the process. The REST API and the client gRPC API share one in-flight count.
The scheduler bounds its own live requests separately (``--max-queued-requests``).
"""

from __future__ import annotations

from starlette.types import Message, Receive

from gateway.errors import APIError, overloaded

# A 128K-token context is under 1 MiB as token ids or text; 4 MiB leaves room for JSON
# escapes and long chat histories while keeping (max in flight x body) bounded.
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_IN_FLIGHT = 1024


class InFlightLimit:
    """A counter of requests being handled, refusing the one past ``limit`` (0: no limit)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"--max-in-flight must be >= 0 (0: no limit), got {limit}")
        self.limit = limit
        self.count = 0

    def acquire(self) -> None:
        """Take a slot, or raise the 429 that tells the client to come back later."""
        if self.limit and self.count >= self.limit:
            raise overloaded(
                f"the gateway is handling {self.count} requests, its limit (--max-in-flight); "
                "retry shortly"
            )
        self.count += 1

    def release(self) -> None:
        self.count -= 1


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"request body is over the {limit}-byte limit (--max-body-bytes); shorten the prompt",
        code="body_too_large",
    )


async def read_body(receive: Receive, limit: int) -> tuple[Message, ...] | APIError:
    """The whole request body as one replayable message, or a 413 once it passes ``limit``.

    Counted as it arrives, so a chunked upload (no Content-Length) is bounded too. A client
    that disconnects mid-body yields its disconnect message for the app to see.
    """
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return (message,)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return body_too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return ({"type": "http.request", "body": b"".join(parts), "more_body": False},)
