"""A small client for tests and experiments behind vllm-router: streamed chat turns that
record which replica answered (the X-SuperInfer-Replica header), the time to the first
token and the usage; multi-turn sessions; the router's own decision log.

Shared by experiments/replicas.py and tests/test_router.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = ("river mountain city garden engine planet music theory window market silver forest "
         "harbor letter bridge winter copper meadow signal lantern orchard canyon").split()


@dataclass
class Turn:
    """One streamed chat completion as the client saw it."""

    session: int
    turn: int
    replica: str | None = None
    request_id: str | None = None
    status: int = 0
    text: str = ""
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: list[str] = field(default_factory=list)  # the content deltas, in order
    error: str | None = None  # an error event, or how the stream broke
    ended_s: float | None = None  # perf_counter when the stream ended

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.completion_tokens is not None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Session:
    """A conversation: a system prompt of its own, then user turns and the replies."""

    def __init__(self, index: int, seed: int, system_words: int = 60,
                 turn_words: int = 30) -> None:
        self.index = index
        self.rng = random.Random(seed * 7919 + index)
        self.turn_words = turn_words
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"Session {seed}-{index}. " + words(self.rng, system_words)}]
        self.turns: list[Turn] = []

    def next_messages(self) -> list[dict[str, str]]:
        t = len(self.turns)
        return [*self.messages, {"role": "user",
                                 "content": f"Question {t}: " + words(self.rng, self.turn_words)}]

    def record(self, messages: list[dict[str, str]], turn: Turn) -> None:
        self.messages = [*messages, {"role": "assistant", "content": turn.text}]
        self.turns.append(turn)


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], *,
               session: int = 0, turn: int = 0, max_tokens: int = 8,
               request_id: str | None = None, extra: dict[str, Any] | None = None,
               ignore_eos: bool = False) -> Turn:
    """One streamed greedy chat completion at `url` (the API root, without /v1)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True},
                            **(extra or {})}
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"X-Request-ID": request_id} if request_id else {}
    out = Turn(session, turn)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as r:
            out.status = r.status_code
            out.replica = r.headers.get("x-superinfer-replica")
            out.request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    out.error = f"error event: {d['error'].get('message')}"
                    continue
                for c in d.get("choices") or ():
                    piece = c.get("delta", {}).get("content")
                    if piece:
                        if out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - t0
                        out.text += piece
                        out.chunks.append(piece)
                usage = d.get("usage")
                if usage:
                    out.prompt_tokens = usage["prompt_tokens"]
                    out.completion_tokens = usage["completion_tokens"]
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"stream broke: {type(e).__name__}: {e}"
    out.ended_s = time.perf_counter()
    return out


async def run_sessions(url: str, sessions: Sequence[Session], turns: int, *,
                       concurrency: int, think_s: float = 0.0, max_tokens: int = 8,
                       stagger_s: float = 0.0) -> list[Turn]:
    """`turns` more turns of every session, in order, `concurrency` sessions at a time
    (each the next turn once its reply is in, `think_s` later); the turns, in the order
    they ended."""
    sem = asyncio.Semaphore(concurrency)
    done: list[Turn] = []
    async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
        async def one(s: Session) -> None:
            await asyncio.sleep(stagger_s * s.index)
            for _ in range(turns):
                async with sem:
                    msgs = s.next_messages()
                    turn = await chat(client, url, msgs, session=s.index, turn=len(s.turns),
                                      max_tokens=max_tokens)
                s.record(msgs, turn)
                done.append(turn)
                if think_s:
                    await asyncio.sleep(think_s)

        await asyncio.gather(*(one(s) for s in sessions))
    return done


def locality(sessions: Sequence[Session]) -> tuple[int, int]:
    """(later turns served by the replica that served the turn before — the one holding
    the conversation's longest prefix —, later turns)."""
    same = total = 0
    for s in sessions:
        for prev, cur in zip(s.turns, s.turns[1:], strict=False):
            total += 1
            same += int(cur.replica is not None and cur.replica == prev.replica)
    return same, total


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DECISION = re.compile(r"KV prefix decision .*?worker=\"?(?P<worker>[^\" ]+)\"? .*?"
                       r"input_tokens=(?P<input>\d+) .*?credited_prefix_tokens=(?P<credit>\d+)")


def kv_decisions(router_log: Path) -> list[tuple[str, int, int]]:
    """vllm-router's kv_aware decisions in its debug log, in order: (worker URL, input
    tokens, credited prefix tokens)."""
    out = []
    for line in router_log.read_text(errors="replace").splitlines():
        m = _DECISION.search(_ANSI.sub("", line))
        if m:
            out.append((m.group("worker"), int(m.group("input")), int(m.group("credit"))))
    return out
