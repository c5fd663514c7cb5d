"""`superinfer bench serve` against the real gateway stack, and its stream/timing logic.

The stack is test_gateway's module-scoped fixture (real worker, kvmem, scheduler and
gateway processes). A short run must finish with no failures, and the request and token
counts the bench reports must equal the deltas of the server's own /metrics for the
same run. Bad input must give one clear line and a non-zero exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.daemon import free_port
from superinfer.bench.serve.prompts import TextTokenizer, fit_prompt, synthetic_prompt
from superinfer.bench.serve.runner import metrics_url
from superinfer.bench.serve.stream import SSEReader, StreamOutcome, error_body_message
from superinfer.cli import main as cli_main
from superinfer.slo_metrics import compute_metrics
from tests.stack import Stack


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The session's stack (tests/stack.py, conftest.py), which test_gateway uses too."""
    return shared_stack


SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "Explain how a refrigerator keeps food cold, step by step."},
        {"from": "gpt", "value": "It moves heat from inside the box to the outside with a "
                                 "refrigerant that evaporates and condenses in a cycle."}]},
    {"id": "b", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "Write a short poem about the sea and the wind at night."},
        {"from": "gpt", "value": "The sea at night is black and deep; the wind sings soft."}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "an entry without a human turn"}]},
]


def _counts(m: dict[Any, float]) -> dict[str, float]:
    def get(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return m.get((name, labels), 0.0)

    return {
        "finished": sum(get("superinfer_requests_total", (("status", s),)) for s in ("length", "stop")),
        "rejected": get("superinfer_requests_total", (("status", "rejected"),)),
        "failed": sum(get("superinfer_requests_total", (("status", s),)) for s in ("abort", "error")),
        "prompt_tokens": get("superinfer_prompt_tokens_total"),
        "generation_tokens": get("superinfer_generation_tokens_total"),
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _bench(stack: Stack, out: Path, *args: str) -> tuple[int, dict[str, Any] | None]:
    rc = cli_main(["bench", "serve", "--base-url", f"{stack.http_url}/v1", "--no-progress",
                   "--json", str(out), *args])
    return rc, json.loads(out.read_text()) if out.exists() else None


# -- against the real stack -------------------------------------------------------------------


def test_short_sweep_completes_and_agrees_with_server_metrics(stack: Stack, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    before = _counts(stack.metrics())
    rc, data = _bench(stack, tmp_path / "out.json", "--num-prompts", "12", "--sweep-rps", "8,30",
                      "--max-prompt-len", "48", "--max-output-len", "8", "--label", "test",
                      "--plot", str(tmp_path / "plot.png"))
    delta = _delta(before, _counts(stack.metrics()))
    assert rc == 0 and data is not None
    printed = capsys.readouterr().out
    for column in ("TTFT", "ITL (TBT)", "TPOT", "E2EL", "goodput", "P99"):
        assert column in printed

    results = data["results"]
    assert [r["rps"] for r in results] == [8.0, 30.0]
    assert data["config"]["model"] == stack.model and data["config"]["tokenizer"].endswith(".gguf")
    for r in results:
        assert r["policy"] == "test"
        assert (r["requests"], r["completed"], r["failed"]) == (12, 12, 0)
        for key in ("ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s",
                    "p99_tbt_s", "goodput_rps", "throughput_tok_s", "rotations"):
            assert r[key] is not None, key
        assert 0 < r["p50_ttft_s"] <= r["p99_ttft_s"]
        assert r["untimed_tokens"] == 0  # the gateway sends one completions chunk per token
        for d in r["per_request"]:
            assert d["error"] is None and d["finish_reason"] == "length"
            # ignore_eos: exactly the trace's lengths; the bundled tokenizer sized the prompt.
            assert d["output_tokens"] == d["trace_output_len"] == len(d["token_times_s"])
            assert d["prompt_tokens"] == d["trace_prompt_len"]
            assert d["token_times_s"] == sorted(d["token_times_s"])
            assert d["ttft_s"] == d["token_times_s"][0] > 0
        # What the bench read from /metrics for this pass equals its own client-side counts.
        server = r["stats"]["server_metrics_delta"]
        assert server["superinfer_requests_total{status=length}"] == 12
        assert server["superinfer_generation_tokens_total"] == r["output_tokens"]
        assert server["superinfer_prompt_tokens_total"] == r["prompt_tokens"]

    # And so does what this test read from /metrics itself around the whole run.
    assert delta["finished"] == sum(r["completed"] for r in results) == 24
    assert delta["generation_tokens"] == sum(r["output_tokens"] for r in results)
    assert delta["prompt_tokens"] == sum(r["prompt_tokens"] for r in results)
    assert delta["rejected"] == delta["failed"] == 0
    # Same seed: the i-th request has the same lengths at both rates.
    lengths = [[(d["trace_prompt_len"], d["trace_output_len"]) for d in r["per_request"]]
               for r in results]
    assert lengths[0] == lengths[1]
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_requests_of_unknown_length_are_ended_by_the_model(stack: Stack, tmp_path: Path) -> None:
    # --max-tokens 16 --no-ignore-eos: every request asks for at most 16 tokens, not its
    # trace length (at most 4 here), and the model's EOS or the cap ends it.
    before = _counts(stack.metrics())
    rc, data = _bench(stack, tmp_path / "out.json", "--num-prompts", "6", "--max-prompt-len",
                      "24", "--max-output-len", "4", "--no-ignore-eos", "--max-tokens", "16")
    delta = _delta(before, _counts(stack.metrics()))
    assert rc == 0 and data is not None
    assert data["config"]["max_tokens"] == 16 and data["config"]["ignore_eos"] is False
    (r,) = data["results"]
    assert (r["completed"], r["failed"]) == (6, 0)
    for d in r["per_request"]:
        assert d["trace_output_len"] <= 4 and 1 <= d["output_tokens"] <= 16
        assert d["finish_reason"] == ("length" if d["output_tokens"] == 16 else "stop")
    assert max(d["output_tokens"] for d in r["per_request"]) > 4  # the trace's length was not sent
    assert delta["finished"] == 6 and delta["generation_tokens"] == r["output_tokens"]


def test_baseline_mode_runs_both_servers_at_each_concurrency(
        stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The stack is also the "other" OpenAI server here: the mode's plumbing, not a speed.
    rc, data = _bench(stack, tmp_path / "out.json", "--baseline-url", f"{stack.http_url}/v1",
                      "--baseline-label", "again", "--streams", "1,3", "--repeats", "2",
                      "--output-len", "4", "--prompt-len", "8-12",
                      "--plot", str(tmp_path / "plot.png"))
    assert rc == 0 and data is not None
    assert "tok/s ratio" in capsys.readouterr().out
    passes = data["passes"]
    assert sorted((p["repeat"], p["streams"], p["side"]) for p in passes) == sorted(
        (r, c, s) for r in (0, 1) for c in (1, 3) for s in ("ours", "baseline"))
    for p in passes:
        assert p["failed"] == 0 and p["requests"] == p["streams"]
        assert p["output_tokens"] == 4 * p["streams"]
        assert p["tok_s"] > 0 and p["itl_ms"] > 0 and p["ttft_s"] > 0
    assert [r["streams"] for r in data["summary"]] == [1, 3]
    for r in data["summary"]:
        assert r["tok_s_ratio"] > 0 and r["ours"]["tok_s"] > 0 and r["baseline"]["tok_s"] > 0
    assert data["config"]["cpu"]["cores"] >= 1 and data["config"]["labels"]["baseline"] == "again"
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_endpoint_with_a_sharegpt_file(stack: Stack, tmp_path: Path) -> None:
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(SHAREGPT))
    before = _counts(stack.metrics())
    rc, data = _bench(stack, tmp_path / "chat.json", "--endpoint", "chat", "--dataset",
                      str(dataset), "--num-prompts", "6", "--max-output-len", "6",  # rate: inf
                      "--max-prompt-len", "10")
    delta = _delta(before, _counts(stack.metrics()))
    assert rc == 0 and data is not None
    (r,) = data["results"]
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["rps"] is None and r["goodput_rps"] is not None  # inf: per second of the run
    assert delta["finished"] == 6
    assert delta["generation_tokens"] == r["output_tokens"] == sum(
        d["trace_output_len"] for d in r["per_request"])
    assert delta["prompt_tokens"] == r["prompt_tokens"]
    for d in r["per_request"]:
        assert len(d["token_times_s"]) == d["output_tokens"]
        # The chat template wraps the prompt, cut to at most 10 tokens of the dataset's text.
        assert d["prompt_tokens"] > d["trace_prompt_len"]


def test_multi_turn_conversations_carry_their_history_and_hit_the_prefix_cache(
        stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two conversations of three turns: each turn's prompt holds the one before it and its
    reply, so the server finds the earlier turns cached (the gateway's stack has prefix
    caching on, the default); the client's cached_tokens agree with the server's hits."""
    rc, data = _bench(stack, tmp_path / "mt.json", "--endpoint", "chat", "--num-prompts", "6",
                      "--rps", "20", "--multi-turn", "3", "--max-prompt-len", "24",
                      "--max-output-len", "12", "--dataset", "sharegpt", "--seed", "4")
    assert rc == 0 and data is not None
    (r,) = data["results"]
    assert (r["completed"], r["failed"]) == (6, 0)
    d = r["per_request"]
    for conv in (0, 1):
        turns = [d[i] for i in (conv, conv + 2, conv + 4)]
        prompts = [t["prompt_tokens"] for t in turns]
        # The history grows by at least the previous user turn and reply each time.
        assert prompts[1] > prompts[0] + turns[0]["output_tokens"]
        assert prompts[2] > prompts[1] + turns[1]["output_tokens"]
        assert turns[1]["cached_tokens"] >= 16 and turns[2]["cached_tokens"] >= 32
        # A turn is sent only after the reply it carries has ended.
        assert turns[1]["sent_s"] >= turns[0]["sent_s"] + turns[0]["e2el_s"]
    server = r["server_prefix_cache"]
    assert server["prefix_cache_hits"] + server["prefix_cache_host_hits"] == r["cached_tokens"]
    assert r["cached_tokens"] > 0 and 0 < r["prefix_cache_hit_rate"] < 1
    assert "prefix cache:" in capsys.readouterr().out


def test_a_shared_system_prompt_is_computed_once(stack: Stack, tmp_path: Path) -> None:
    rc, data = _bench(stack, tmp_path / "sys.json", "--num-prompts", "6", "--rps", "2",
                      "--system-prompt-len", "64", "--max-prompt-len", "16",
                      "--max-output-len", "4", "--seed", "5")
    assert rc == 0 and data is not None
    (r,) = data["results"]
    d = sorted(r["per_request"], key=lambda x: x["sent_s"])
    assert all(x["prompt_tokens"] >= 64 for x in d)
    # Every request sent once an earlier one had its first token (its prompt, system
    # prompt included, computed) finds the system prompt's full blocks cached. Which ones
    # those are depends on the machine's speed (a request sent while the first prompt is
    # still computing computes it too); at 2 req/s most are.
    done = min(x["sent_s"] + x["ttft_s"] for x in d)
    after = [x for x in d if x["sent_s"] > done]
    assert len(after) >= 2, [(x["sent_s"], x["ttft_s"]) for x in d]
    assert all(x["cached_tokens"] >= 48 for x in after), after


def test_rejected_requests_are_recorded_not_fatal(stack: Stack, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Prompts longer than the 8192-token context: the gateway answers 400 to each.
    before = _counts(stack.metrics())
    rc, data = _bench(stack, tmp_path / "bad.json", "--num-prompts", "3", "--rps", "50",
                      "--length-scale", "100000", "--max-prompt-len", "9000", "--max-output-len", "4")
    delta = _delta(before, _counts(stack.metrics()))
    assert rc == 2 and data is not None
    (r,) = data["results"]
    assert (r["completed"], r["failed"], r["ttft_attainment"]) == (0, 3, 0.0)
    for d in r["per_request"]:
        assert d["http_status"] == 400 and "maximum context length" in d["error"]
    assert delta["rejected"] == 3
    assert "every request failed" in capsys.readouterr().err


def test_malformed_sharegpt_file(stack: Stack, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text('[{"conversations": [')
    rc, data = _bench(stack, tmp_path / "x.json", "--dataset", str(bad), "--num-prompts", "2")
    assert rc == 2 and data is None
    err = capsys.readouterr().err.strip()
    assert err.startswith("superinfer bench serve: error: dataset file") and "not valid JSON" in err
    wrong_shape = tmp_path / "dict.json"
    wrong_shape.write_text('{"conversations": []}')
    rc, _ = _bench(stack, tmp_path / "x.json", "--dataset", str(wrong_shape), "--num-prompts", "2")
    assert rc == 2 and "expected a JSON list" in capsys.readouterr().err


# -- bad input without a server -------------------------------------------------------------




def test_unreachable_url_is_one_clear_line_from_the_cli() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    p = subprocess.run([sys.executable, "-m", "superinfer.cli", "bench", "serve", "--base-url", url,
                        "--num-prompts", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach {url}/models" in lines[0], p.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--dataset", "/nonexistent/sharegpt.json"], "neither a synthetic dataset"),
    (["--duration", "10"], "--duration needs a finite --rps"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--rps", "2", "--max-prompt-len", "2"], "min_len <= max_prompt_len"),
    (["--max-tokens", "256"], "needs --no-ignore-eos"),
])
def test_bad_options_fail_before_contacting_a_server(args: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: these must not get that far
    assert cli_main(["bench", "serve", "--base-url", url, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# -- conversations and system prompts ----------------------------------------------------------


def test_conversation_turns_and_bodies() -> None:
    from superinfer.bench.serve.prompts import BodyOptions, Conversations
    from superinfer.workload import TraceRequest

    trace = [TraceRequest(i, 0.1 * i, 4, 2) for i in range(5)]
    conv = Conversations(5, 2)  # conversations: [0, 3], [1, 4], [2]
    assert conv.count == 3
    assert [conv.previous(i) for i in range(5)] == [None, None, None, 0, 1]
    assert Conversations(5, 1).previous(4) is None
    texts = [f"q{i}" for i in range(5)]
    outcomes = [StreamOutcome(index=i, scheduled_s=0.0, text=f" a{i}") for i in range(5)]
    chat = conv.bodies(trace, texts, BodyOptions("chat", "m", system="be brief"))
    assert chat(3, outcomes)["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "q0"},
        {"role": "assistant", "content": " a0"}, {"role": "user", "content": "q3"}]
    assert chat(2, outcomes)["messages"][1:] == [{"role": "user", "content": "q2"}]
    comp = conv.bodies(trace, texts, BodyOptions("completions", "m"))
    # The earlier prompt and its reply, as generated, are a prefix of the next prompt.
    assert comp(4, outcomes)["prompt"] == "q1 a1\n\nq4"
    assert comp(1, outcomes)["prompt"] == "q1"


def test_max_tokens_is_the_trace_length_a_cap_or_absent() -> None:
    from superinfer.bench.serve.prompts import BodyOptions, request_body
    from superinfer.workload import TraceRequest

    req = TraceRequest(0, 0.0, 4, 7)
    assert request_body(req, "q", BodyOptions("completions", "m"))["max_tokens"] == 7
    capped = request_body(req, "q", BodyOptions("chat", "m", ignore_eos=False, max_tokens=256))
    assert capped["max_tokens"] == 256 and "ignore_eos" not in capped
    bare = request_body(req, "q", BodyOptions("chat", "m", ignore_eos=False, max_tokens=None))
    assert "max_tokens" not in bare and "ignore_eos" not in bare


def test_the_reader_keeps_the_reply_and_cached_tokens() -> None:
    out = StreamOutcome(index=0, scheduled_s=0.0)
    reader = SSEReader(out, "chat")
    for i, text in enumerate(["Hel", "lo"]):
        reader.feed("data: " + json.dumps({"choices": [{"delta": {"content": text}}]}), float(i))
    reader.feed("data: " + json.dumps({"choices": [], "usage": {
        "prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32}}}), 2.0)
    assert out.text == "Hello" and out.cached_tokens == 32 and out.prompt_tokens == 40


# -- the stream reader and the timing rule ----------------------------------------------------


def _completion(text: str, finish: str | None = None) -> str:
    return "data: " + json.dumps({"object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": finish}]})


def _chat(content: str | None, finish: str | None = None, role: bool = False) -> str:
    delta: dict[str, str] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]})


def _usage(prompt: int, completion: int) -> str:
    return "data: " + json.dumps({"choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion}})


def _read(endpoint: str, lines: list[tuple[float, str]]) -> StreamOutcome:
    out = StreamOutcome(index=0, scheduled_s=0.0, sent_at=10.0)
    reader = SSEReader(out, endpoint)
    for t, line in lines:
        reader.feed(line, t)
        reader.feed("", t)  # the blank line between events
    reader.finish(lines[-1][0] + 0.001)
    return out


def test_completions_stream_times_each_chunk_as_a_token() -> None:
    out = _read("completions", [
        (10.5, _completion("Hello")),
        (10.6, _completion("")),  # a token whose text is held back (half a character)
        (10.7, _completion(" wörld")),
        (10.9, _completion("!", "length")),
        (10.9, _usage(7, 4)),
        (10.9, "data: [DONE]"),
    ])
    assert out.ok and out.finish_reason == "length"
    assert (out.prompt_tokens, out.output_tokens, out.untimed_tokens) == (7, 4, 0)
    assert out.token_times() == [10.5, 10.6, 10.7, 10.9]
    rec = out.record("r0", ttft_slo_s=1.0, tbt_slo_s=0.15)
    assert rec.ttft_s == pytest.approx(0.5)
    assert rec.gaps() == pytest.approx([0.1, 0.1, 0.2])
    m = compute_metrics([rec])
    assert m.output_tokens == 4 and m.tbt_attainment == pytest.approx(2 / 3)


def test_chat_stream_extra_tokens_are_timed_at_the_last_chunk() -> None:
    out = _read("chat", [
        (11.0, _chat("", role=True)),  # the opening role chunk carries no token
        (11.2, _chat("Hi")),
        (11.5, _chat(" there")),  # say it carried two tokens: the count comes from usage
        (11.6, _chat(None, "stop")),
        (11.6, _usage(20, 4)),
        (11.6, "data: [DONE]"),
    ])
    assert out.ok and out.untimed_tokens == 2
    assert out.token_times() == [11.2, 11.5, 11.6, 11.6]


def test_without_usage_the_chunks_are_the_count_and_extra_chunks_are_dropped() -> None:
    out = _read("completions", [(1.0, _completion("a")), (1.1, _completion("b", "stop"))])
    assert out.ok and out.output_tokens is None and out.token_times() == [1.0, 1.1]
    out = _read("completions", [(1.0, _completion("a")), (1.1, _completion("b")),
                                (1.2, _completion("c", "length")), (1.2, _usage(1, 2))])
    assert out.token_times() == [1.0, 1.1]


@pytest.mark.parametrize(("lines", "message"), [
    ([_completion("a"), 'data: {"error": {"message": "the engine failed", "code": "x"}}'],
     "error event: the engine failed"),
    ([_completion("a"), _completion("b")], "no finish_reason"),
    ([_completion("a", "abort"), "data: [DONE]"], "finish_reason='abort'"),
    (["data: {not json"], "not JSON"),
])
def test_incomplete_or_failed_streams_are_failures(lines: list[str], message: str) -> None:
    out = _read("completions", [(1.0 + i / 10, line) for i, line in enumerate(lines)])
    assert not out.ok and out.error is not None and message in out.error
    assert not out.record("r", 1.0, 1.0).finished


def test_error_bodies_and_metrics_url() -> None:
    body = json.dumps({"error": {"message": "prompt is too long", "type": "invalid_request_error"}})
    assert error_body_message(400, body.encode()) == "HTTP 400: prompt is too long"
    assert error_body_message(502, b"<html>\n bad gateway </html>") == "HTTP 502: <html> bad gateway </html>"
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"


# -- prompt text ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_tokenizer() -> TextTokenizer:
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))
    return TextTokenizer(encode=lambda t: tok.encode(t, add_special_tokens=False),
                         decode=lambda ids: tok.decode(ids))


@pytest.mark.parametrize("n", [1, 4, 37, 600])
def test_synthetic_prompts_have_the_trace_length(n: int, bundled_tokenizer: TextTokenizer) -> None:
    text = synthetic_prompt(n, index=3, seed=0, tok=bundled_tokenizer)
    assert len(bundled_tokenizer.encode(text)) == n
    assert text == synthetic_prompt(n, index=3, seed=0, tok=bundled_tokenizer)
    assert text != synthetic_prompt(n, index=4, seed=0, tok=bundled_tokenizer) or n == 1
    # Without a tokenizer: n words, each one token in the bundled vocabulary.
    plain = synthetic_prompt(n, index=3, seed=0, tok=None)
    assert len(plain.split()) == n and len(bundled_tokenizer.encode(plain)) == n


def test_dataset_prompts_are_cut_never_padded(bundled_tokenizer: TextTokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 10
    cut = fit_prompt(text, 12, bundled_tokenizer)
    assert len(bundled_tokenizer.encode(cut)) == 12 and text.startswith(cut)
    assert fit_prompt(text, 10_000, bundled_tokenizer) == text
    assert fit_prompt(text, 5, None) == text[:20]


@pytest.mark.parametrize("no_progress", [False, True])
def test_progress_bar_on_a_terminal_only_when_asked(stack: Stack, tmp_path: Path,
                                                    no_progress: bool) -> None:
    """The tqdm bar goes to stderr when it is a terminal (a pty here), and --no-progress
    turns it off; stdout keeps the table either way."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    # A terminal has a size; a fresh pty's is 0x0, where tqdm draws a bar of width 0.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    argv = [sys.executable, "-m", "superinfer.cli", "bench", "serve", "--base-url",
            f"{stack.http_url}/v1", "--num-prompts", "4", "--rps", "inf",
            "--max-prompt-len", "32", "--max-output-len", "4",
            "--json", str(tmp_path / "out.json"), *(["--no-progress"] if no_progress else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end (EIO on Linux)
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, seen.decode(errors="replace")
    assert "TTFT" in out
    bar = b"/4 [" in seen and b"req/s]" in seen  # "1/4 [00:00<00:02,  1.28req/s]"
    assert bar is not no_progress, seen.decode(errors="replace")
