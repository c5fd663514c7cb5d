"""One streamed request: send it, read its SSE events, and time its tokens.

Timing rule (explicit, because an OpenAI stream does not say how many tokens a chunk
holds): every chunk with output text is timed when its line is read, as vLLM's
`bench serve` times its inter-token latencies, and counts as one token. A completions
chunk with empty text and no finish_reason also counts (SuperInfer sends one per token
whose text it holds back, e.g. half of a UTF-8 character). The token count itself comes
from the final `usage` (stream_options.include_usage); tokens beyond the timed chunks
(a chunk that carried several, or a last token with no text) are timed at the stream's
last chunk, and chunks beyond the count are dropped from the end. With SuperInfer's
completions endpoint, one chunk is one token, so nothing is moved; each result reports
how many tokens this rule placed (`untimed_tokens`) so a server that batches chunks is
visible. Without usage, the timed chunks are the count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from superinfer.slo_metrics import RequestRecord

GOOD_FINISH = ("length", "stop")


@dataclass(slots=True)
class StreamOutcome:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    index: int
    scheduled_s: float  # arrival offset in the trace
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    last_chunk_at: float | None = None
    done_at: float | None = None
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    text: str = ""  # the reply (a multi-turn conversation sends it back in the next turn)
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None
    # Which replica answered, behind a router (a SuperInfer replica's X-SuperInfer-Replica).
    replica: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def token_times(self) -> list[float]:
        """One time per output token, by the rule in this module's docstring."""
        times = list(self.chunk_times)
        n = self.output_tokens
        if n is None:
            return times
        if len(times) >= n:
            return times[:n]
        last = self.last_chunk_at if self.last_chunk_at is not None else (times[-1] if times else None)
        if last is None:
            return []
        return times + [last] * (n - len(times))

    @property
    def untimed_tokens(self) -> int:
        n = self.output_tokens
        return max(0, n - len(self.chunk_times)) if n is not None else 0

    def record(self, request_id: str, ttft_slo_s: float, tbt_slo_s: float,
               slo_class: str | None = None) -> RequestRecord:
        return RequestRecord(
            request_id=request_id,
            arrival_s=self.sent_at,
            token_times=self.token_times(),
            ttft_slo_s=ttft_slo_s,
            tbt_slo_s=tbt_slo_s,
            prompt_tokens=self.prompt_tokens or 0,
            finished=self.ok,
            slo_class=slo_class,
        )


class SSEReader:
    """Feeds on an OpenAI SSE stream line by line and fills a StreamOutcome."""

    def __init__(self, outcome: StreamOutcome, endpoint: str) -> None:
        self.out = outcome
        self.chat = endpoint == "chat"
        self.done = False

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, event: / id: fields
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.out.error = f"the server sent an event that is not JSON: {data[:120]!r}"
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            self.out.error = "the server sent an error event: " + _message(event["error"])
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.out.prompt_tokens = usage.get("prompt_tokens")
            self.out.output_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.out.cached_tokens = details["cached_tokens"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            self.out.last_chunk_at = now
            if self.chat:
                text = (choice.get("delta") or {}).get("content")
                counted = bool(text)
            else:
                text = choice.get("text")
                counted = bool(text) or (text == "" and choice.get("finish_reason") is None)
            if counted:
                self.out.chunk_times.append(now)
            if isinstance(text, str):
                self.out.text += text
            if choice.get("finish_reason"):
                self.out.finish_reason = choice["finish_reason"]

    def finish(self, now: float) -> None:
        """The stream ended: decide whether the request completed."""
        self.out.done_at = now
        if self.out.error is not None:
            return
        if self.out.finish_reason is None:
            self.out.error = "the stream ended before the request finished (no finish_reason)"
        elif self.out.finish_reason not in GOOD_FINISH:
            self.out.error = f"the server ended the request with finish_reason={self.out.finish_reason!r}"


def _message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def error_body_message(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and "error" in parsed:
        text = _message(parsed["error"])
    elif isinstance(parsed, dict) and "detail" in parsed:
        text = str(parsed["detail"])
    return f"HTTP {status}: {' '.join(text.split())[:300]}"


async def send(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], outcome: StreamOutcome,
    endpoint: str, headers: dict[str, str] | None = None,
) -> StreamOutcome:
    """POST one streaming request; failures land in outcome.error, never raise."""
    reader = SSEReader(outcome, endpoint)
    outcome.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            outcome.http_status = r.status_code
            outcome.replica = r.headers.get("x-superinfer-replica")
            if r.status_code != 200:
                outcome.error = error_body_message(r.status_code, await r.aread())
                outcome.done_at = time.perf_counter()
                return outcome
            async for line in r.aiter_lines():
                reader.feed(line, time.perf_counter())
                if reader.done or outcome.error is not None:
                    break
    except httpx.HTTPError as e:
        outcome.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    reader.finish(time.perf_counter())
    return outcome
