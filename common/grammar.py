"""Structured outputs: a request's `Grammar` in the grammar library's terms.

The library is llguidance, chosen by measuring the per-token mask time on this CPU (median
per row and token: xgrammar 0.004 ms, llguidance 0.017 ms, outlines-core 0.34 ms; xgrammar
was faster but pulls in heavy dependencies, llguidance needs none). `python -m experiments
grammar` measures llguidance's mask in this code (docs/results/grammar/). The gateway validates here, so a grammar the library cannot compile is a
400 naming the problem before a request reaches the scheduler; the worker compiles the
same text into matchers (worker/grammar.py). Nothing else in the project names the library.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from common.contracts import GRAMMAR_KINDS, Grammar

# JSON as json.dumps writes it: one space after ':' and ',', no other whitespace. With
# free whitespace a small model may emit blanks until max_tokens.
if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message says why."""


def to_library(g: Grammar) -> str:
    """The llguidance grammar (its JSON form) for `g`; GrammarError if it is malformed."""
    if g.kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {g.kind!r}; use one of {', '.join(GRAMMAR_KINDS)}")
    if g.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=_JSON_OPTIONS)
    if g.kind == "json_schema":
        try:
            schema = json.loads(g.spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
    if g.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(g.spec)
    if g.kind == "choice":
        try:
            choices = json.loads(g.spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"choices are not a JSON list: {e}") from None
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise GrammarError("choices must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes, so each choice is matched verbatim.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(g.spec)


def check(g: Grammar) -> None:
    """Raise GrammarError naming the problem when the library cannot compile `g`."""
    text = to_library(g)
    problem = llguidance.LLMatcher.validate_grammar(text)
    if problem and not problem.startswith("WARNING"):
        what = {"json_schema": "JSON schema", "json_object": "JSON object grammar",
                "regex": "regex", "choice": "choice list", "lark": "Lark grammar"}[g.kind]
        raise GrammarError(f"the {what} cannot be compiled: {problem.strip()}")
