"""Request bodies for `bench serve`: prompt text of about the trace's length, and the body.

Synthetic traces give lengths only, so prompt text is made from common English words
drawn with a seeded generator (request i gets the same words at every rate). Each word
with its leading space is one token in the bundled model's vocabulary (and in most BPE
vocabularies), so n words are about n tokens; with a tokenizer the text is cut to
exactly n tokens. Dataset prompts are sent as they are, cut to the trace's prompt length
when --max-prompt-len or --length-scale shortened it (with a tokenizer: by tokens;
without: at 4 characters per token, the workload's estimate). What the server really
counted comes back in `usage` and is what the results report.

Two shapes of chat traffic that prefix caching is for: a shared system prompt (the same
`--system-prompt-len` tokens before every request's own text) and multi-turn
conversations, where each turn's prompt is the conversation so far — every earlier user
turn and the server's own replies — followed by the new user turn (`Turn`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from superinfer.workload import TraceRequest

WORDS = tuple(dict.fromkeys("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education good new first last long great little own
other old big high different small large next early young important few public bad same able
make know take see come think look want give use find tell ask seem feel try leave call keep let
begin help show hear play run move like live believe hold bring happen write provide sit stand
lose pay meet include continue set learn lead understand watch follow stop create speak read
allow add spend grow open walk win offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull
river garden music window paper table light green blue simple clear warm quiet bright
""".split()))

CHARS_PER_TOKEN = 4  # the workload's estimate when no tokenizer counts

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


@dataclass(slots=True, frozen=True)
class TextTokenizer:
    """The two calls prompt building needs (a superinfer Tokenizer provides both)."""

    encode: Encode
    decode: Decode


def synthetic_prompt(n_tokens: int, index: int, seed: int, tok: TextTokenizer | None) -> str:
    rng = np.random.default_rng([seed, index])
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_tokens + 8)]
    if tok is None:
        return " ".join(words[:n_tokens])
    ids = tok.encode(" ".join(words))
    return tok.decode(ids[:n_tokens])


def fit_prompt(text: str, n_tokens: int, tok: TextTokenizer | None) -> str:
    """A dataset prompt cut to at most n_tokens (never padded)."""
    if tok is None:
        limit = n_tokens * CHARS_PER_TOKEN
        return text if len(text) <= limit else text[:limit]
    ids = tok.encode(text)
    return text if len(ids) <= n_tokens else tok.decode(ids[:n_tokens])


def system_prompt(n_tokens: int, seed: int, tok: TextTokenizer | None) -> str:
    """The shared system prompt: the same words for every request of a run."""
    return synthetic_prompt(n_tokens, 1 << 32, seed, tok) if n_tokens > 0 else ""  # no request's index


def prompt_text(req: TraceRequest, seed: int, tok: TextTokenizer | None) -> str:
    if req.prompt is None:
        return synthetic_prompt(req.prompt_len, req.index, seed, tok)
    return fit_prompt(req.prompt, req.prompt_len, tok)


TRACE_LENGTH = "trace"  # BodyOptions.max_tokens: ask for the trace's output length


@dataclass(slots=True, frozen=True)
class BodyOptions:
    endpoint: str  # "completions" or "chat"
    model: str
    temperature: float = 0.0
    ignore_eos: bool = True
    ttft_slo_s: float | None = None  # sent in the `slo` extra when set
    tbt_slo_s: float | None = None
    system: str = ""  # a system prompt shared by every request ("" = none)
    # What each request asks for as max_tokens: TRACE_LENGTH, the trace's output length
    # (with ignore_eos, exactly that many tokens); a number, the same cap for every request
    # (a client's generous bound; the model's EOS ends it); None, no max_tokens at all (the
    # server's bound: the model's context).
    max_tokens: int | str | None = TRACE_LENGTH


@dataclass(slots=True, frozen=True)
class Turn:
    """An earlier turn of the same conversation: what the user sent, what came back."""

    user: str
    reply: str


@dataclass(slots=True, frozen=True)
class Conversations:
    """A trace's requests as the user turns of conversations of `turns` turns: request i
    is turn i // C of conversation i % C, with C = ceil(requests / turns) (so turns of a
    conversation are spread across the run, other traffic between them). turns = 1: every
    request on its own."""

    num_requests: int
    turns: int = 1

    @property
    def count(self) -> int:
        return -(-self.num_requests // self.turns)

    def previous(self, i: int) -> int | None:
        """The request whose reply request i's prompt carries last (None: a first turn)."""
        return i - self.count if self.turns > 1 and i >= self.count else None

    def bodies(self, trace: Sequence[TraceRequest], texts: Sequence[str],
               opt: BodyOptions) -> Callable[[int, Sequence[Any]], dict[str, Any]]:
        """Request i's body, given the outcomes so far (each with the reply's `text`)."""
        def body(i: int, outcomes: Sequence[Any]) -> dict[str, Any]:
            earlier = range(i % self.count, i, self.count) if self.turns > 1 else ()
            history = [Turn(texts[j], outcomes[j].text) for j in earlier]
            return request_body(trace[i], texts[i], opt, history)
        return body


def request_body(req: TraceRequest, text: str, opt: BodyOptions,
                 history: Sequence[Turn] = ()) -> dict[str, Any]:
    """An OpenAI streaming request asking for the trace's output length (or what
    `opt.max_tokens` says); with `history`, its prompt is the conversation so far and then
    `text`."""
    body: dict[str, Any] = {
        "model": opt.model,
        "temperature": opt.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cap = req.output_len if opt.max_tokens == TRACE_LENGTH else opt.max_tokens
    if cap is not None:
        body["max_tokens"] = cap
    if opt.endpoint == "chat":
        messages = [{"role": "system", "content": opt.system}] if opt.system else []
        for turn in history:
            messages += [{"role": "user", "content": turn.user},
                         {"role": "assistant", "content": turn.reply}]
        body["messages"] = [*messages, {"role": "user", "content": text}]
    else:
        # A plain transcript, a paragraph per turn: each reply right after the text it
        # continued, as it was generated (so the earlier prompt is a prefix of this one).
        parts = [opt.system] if opt.system else []
        parts += [turn.user + turn.reply for turn in history]
        body["prompt"] = "\n\n".join([*parts, text])
    if opt.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and SuperInfer's extra: output lengths follow the trace
    if opt.ttft_slo_s is not None and opt.tbt_slo_s is not None:
        # A request of an SLO class carries its class's SLOs, the others the run's.
        ttft, tbt = (req.slo.ttft_s, req.slo.tbt_s) if req.slo else (opt.ttft_slo_s, opt.tbt_slo_s)
        body["slo"] = {"ttft_ms": ttft * 1000.0, "tbt_ms": tbt * 1000.0}
    return body
