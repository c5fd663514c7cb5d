"""Request bodies for `bench serve`: prompt text of about the trace's length, and the body.

Synthetic traces give lengths only, so prompt text is made from common English words
drawn with a seeded generator (request i gets the same words at every rate). Each word
with its leading space is one token in the bundled model's vocabulary (and in most BPE
vocabularies), so n words are about n tokens; with a tokenizer the text is cut to
exactly n tokens. Dataset prompts are sent as they are, cut to the trace's prompt length
when --max-prompt-len or --length-scale shortened it (with a tokenizer: by tokens;
without: at 4 characters per token, the workload's estimate). What the server really
counted comes back in `usage` and is what the results report.
"""

from __future__ import annotations

from collections.abc import Callable
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


def prompt_text(req: TraceRequest, seed: int, tok: TextTokenizer | None) -> str:
    if req.prompt is None:
        return synthetic_prompt(req.prompt_len, req.index, seed, tok)
    return fit_prompt(req.prompt, req.prompt_len, tok)


@dataclass(slots=True, frozen=True)
class BodyOptions:
    endpoint: str  # "completions" or "chat"
    model: str
    temperature: float = 0.0
    ignore_eos: bool = True
    ttft_slo_s: float | None = None  # sent in the `slo` extra when set
    tbt_slo_s: float | None = None


def request_body(req: TraceRequest, text: str, opt: BodyOptions) -> dict[str, Any]:
    """An OpenAI streaming request asking for exactly the trace's output length."""
    body: dict[str, Any] = {
        "model": opt.model,
        "max_tokens": req.output_len,
        "temperature": opt.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opt.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if opt.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and SuperInfer's extra: output lengths follow the trace
    if opt.ttft_slo_s is not None and opt.tbt_slo_s is not None:
        # A request of an SLO class carries its class's SLOs, the others the run's.
        ttft, tbt = (req.slo.ttft_s, req.slo.tbt_s) if req.slo else (opt.ttft_slo_s, opt.tbt_slo_s)
        body["slo"] = {"ttft_ms": ttft * 1000.0, "tbt_ms": tbt * 1000.0}
    return body
