"""Speculative decoding in `superinfer serve` (float32, a device pool that rotates): with a
kill -9 of the worker while greedy streams speculate, every stream ends with the text it
has with speculation off; vLLM's spec-decode counters reach /metrics; nothing leaks."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.speculative import SpeculativeConfig
from tests.test_recovery import (
    Serve,
    Stream,
    assert_clean,
    kill,
    mean_tokens,
    next_token_after,
    run_load,
    serving,
    until,
)

MAX_TOKENS = 64
# Input-grounded prompts: the answer restates text from the prompt, so prompt lookup's
# drafts are often right (and sometimes wrong: both paths run).
PASSAGES = [
    "The new backup job runs every nigth at two and keeps seven copies of each database.",
    "Our harbour opens at six; the ferry to the island leaves evry hour until dusk.",
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
    "Name: Ada Brook\nCity: Lisbon\nRole: data engineer\nTeam: storage\nStart: March",
    "First heat the oven, then mix the flour and the water, then knead the dough for ten "
    "minutes, then let it rest for an hour.",
    "Meeting notes: the release moves to Friday, Sam owns the migration, Kim writes the "
    "announcement, and the budget stays the same.",
]
PROMPTS = [f"Rewrite the following text, fixing any spelling mistakes.\n\nText:\n{p}\n\n"
           f"Rewritten text:\n" for p in PASSAGES]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    config = SpeculativeConfig(num_speculative_tokens=4)
    with serving(tmp_path_factory.mktemp("speculative"), "--dtype", "float32",
                 "--speculative-config", config.to_json()) as s:
        s.note_segment()
        yield s


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_a_worker_killed_while_streams_speculate_changes_no_token(serve: Serve) -> None:
    off = run_load(serve, PROMPTS, max_tokens=MAX_TOKENS, extra={"speculative": False})
    assert all(s.error is None and s.finish_reason == "length" for s in off)
    c0 = serve.stats().counters
    assert c0.get("spec_decode_num_drafts", 0.0) == 0.0  # turned off per request
    times: dict[str, float] = {}

    async def chaos(streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
        await until(lambda: mean_tokens(streams) >= 12)
        _, t = kill(serve, "worker")
        times["worker"] = await next_token_after(streams, t)

    on = run_load(serve, PROMPTS, chaos, max_tokens=MAX_TOKENS)
    print(f"\nrecovery time, kill -9 -> next token to any client: {times['worker']:.2f} s")
    for a, b in zip(off, on, strict=True):
        assert b.error is None and b.finish_reason == "length" and b.done
        assert b.text == a.text, "speculation or the restart changed a stream"
    c = serve.stats().counters
    assert c["device_losses"] >= c0["device_losses"] + 1
    assert 0 < c["spec_decode_num_accepted_tokens"] <= c["spec_decode_num_draft_tokens"]
    metrics = httpx.get(f"{serve.url}/metrics", timeout=10, trust_env=False).text
    assert _metric(metrics, "vllm:spec_decode_num_drafts_total") == c["spec_decode_num_drafts"]
    assert (_metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
            == c["spec_decode_num_accepted_tokens"])
    per_pos = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == c["spec_decode_num_accepted_tokens"]
    assert_clean(serve)


def test_a_bad_speculative_field_is_a_400(serve: Serve) -> None:
    r = httpx.post(f"{serve.url}/v1/completions", timeout=30, trust_env=False,
                   json={"model": serve.model, "prompt": "hi", "max_tokens": 2,
                         "speculative": "sometimes"})
    assert r.status_code == 400, r.text




def test_bench_serve_speculative_reports_on_off_acceptance_and_exactness(
        serve: Serve, tmp_path: Path) -> None:
    """`bench serve --speculative` on a small prompt file: the results.json keys per
    workload and stream count; float32, so every text is the same on and off."""
    from superinfer.cli import main

    rows = [{"id": f"{kind}-{i}", "kind": kind, "max_tokens": 12,
             "messages": [{"role": "user", "content": text}]}
            for i, (kind, text) in enumerate([
                ("rewrite", "Fix the spelling and write it again: " + PASSAGES[0]),
                ("extract", "Give the name and the city as JSON: " + PASSAGES[3]),
                ("open-chat", "What is a hash table?")])]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.json"
    assert main(["bench", "serve", "--speculative", "--base-url", f"{serve.url}/v1",
                 "--dataset", str(data), "--streams", "1,2", "--repeats", "1",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["input-grounded@1", "input-grounded@2", "open-chat@1",
                               "open-chat@2"]
    for row in results.values():
        assert {"tok_s_on", "tok_s_off", "speedup", "acceptance_rate", "exact"} <= set(row)
        assert row["exact"]["count"] == row["exact"]["total"] > 0
        assert 0.0 <= row["acceptance_rate"] <= 1.0


def test_stop_strings_and_usage_through_rest_see_accepted_tokens_only(serve: Serve) -> None:
    """A stop string inside an accepted run: the text, finish reason, usage and logprobs
    of the REST answer are those of speculation off."""

    def complete(speculative: bool, **extra: object) -> dict[str, Any]:
        body = {"model": serve.model, "prompt": PROMPTS[0], "max_tokens": 40,
                "temperature": 0, "speculative": speculative, **extra}
        r = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=120, trust_env=False)
        assert r.status_code == 200, r.text
        return r.json()

    drafts = serve.stats().counters.get("spec_decode_num_accepted_tokens", 0.0)
    free = complete(False)["choices"][0]["text"]
    words = free.split()
    assert len(words) > 6
    stop = " ".join(words[len(words) // 2: len(words) // 2 + 2])
    for extra in ({"stop": [stop]}, {"stop": [stop], "logprobs": 2}):
        off, on = complete(False, **extra), complete(True, **extra)
        a, b = off["choices"][0], on["choices"][0]
        assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"]) == (
            free[: free.index(stop)], "stop")
        assert on["usage"] == off["usage"]
        if "logprobs" in extra:
            assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
    # the speculative answers did run on accepted drafts
    assert serve.stats().counters["spec_decode_num_accepted_tokens"] > drafts
