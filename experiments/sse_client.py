"""A lean streaming client for the benchmarks that share the machine with the server.

The overhead and pipeline studies run their client on the same 2 cores as the
gateway, scheduler and worker, so whatever CPU the client burns per SSE event is taken
from the forward pass and shows up as serving overhead that a real (remote) client would
not cause. httpx spends ~0.3 CPU-s per 2048 events here (py-spy: its anyio cancel scopes,
httpcore's per-read machinery, line decoding). This client sends one HTTP/1.1 POST per
stream on a plain asyncio connection and parses the response with httptools (C, what
uvicorn's server side uses) inside `data_received`: no task wake-up per event.

What it reads is the same as before: every `data: {...}` line is JSON-decoded, an error
event fails the request, the `usage` event gives the token count, and the first other
event is the first token (timed when its bytes arrive). Plain http:// only.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools


@dataclass(slots=True)
class StreamTimes:
    first: float  # time.monotonic() of the first token event (0.0: none came)
    tokens: int  # completion_tokens from the usage event (0: none came)


class _SSEStream(asyncio.Protocol):
    """One POST, its chunked SSE response parsed as it arrives."""

    def __init__(self, request: bytes, done: asyncio.Future[StreamTimes]) -> None:
        self.request = request
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.pending = b""  # a line not complete yet
        self.error_body = b""
        self.first = 0.0
        self.tokens = 0
        self.transport: asyncio.Transport | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:  # one of ours raised: an error event
            cause = e.__cause__ or e.__context__
            self._fail(cause if isinstance(cause, Exception) else e)
        except httptools.HttpParserError as e:
            self._fail(RuntimeError(f"the gateway sent a malformed response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the gateway closed the stream early ({exc or 'EOF'})"))

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        now = time.monotonic()
        lines = (self.pending + body).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            self._line(line.rstrip(b"\r"), now)

    def on_message_complete(self) -> None:
        if self.status != 200:
            self._fail(RuntimeError(f"gateway answered {self.status}: {self.error_body[:300]!r}"))
        elif not self.done.done():
            self.done.set_result(StreamTimes(self.first, self.tokens))
        if self.transport is not None:
            self.transport.close()

    # -- SSE ------------------------------------------------------------------------------------
    def _line(self, line: bytes, now: float) -> None:
        if not line.startswith(b"data: {"):
            return
        event = json.loads(line[len(b"data: "):])
        if "error" in event:
            raise RuntimeError(f"stream failed: {event['error']}")
        if event.get("usage"):
            self.tokens = event["usage"]["completion_tokens"]
        elif not self.first:
            self.first = now

    def _fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()


async def stream_post(url: str, path: str, body: dict[str, object]) -> StreamTimes:
    """POST `body` as JSON to `url` + `path` and read its SSE stream to the end."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"the lean client speaks plain http:// only, not {url!r}")
    port = parts.port or 80
    payload = json.dumps(body).encode()
    host = f"{parts.hostname}:{port}"
    request = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}\r\n"
               f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    done: asyncio.Future[StreamTimes] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _SSEStream(request, done),
                                                parts.hostname, port)
    try:
        return await done
    finally:
        transport.close()
