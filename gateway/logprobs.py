"""Logprobs in OpenAI's two shapes: legacy completions' parallel lists and chat's objects.

A token's string is what decoding that one token gives (a byte-level token that ends in
the middle of a UTF-8 character shows U+FFFD, as OpenAI's do); chat's `bytes` are the
token's raw bytes, so a client can reassemble such characters.
"""

from __future__ import annotations

from functools import lru_cache

from common.contracts import TokenLogprob
from common.tokenizer import Tokenizer
from gateway.openai_schema import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Each token's string and bytes, cached (a stream asks for the same ones often)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._text.get(token_id)
        if t is None:
            t = self._text[token_id] = self._tok.decode([token_id])
        return t

    def raw_bytes(self, token_id: int) -> list[int]:
        entry = self._tok.token_text(token_id) or ""
        table = _byte_decoder()
        if entry and token_id not in self._tok.special_ids and all(ch in table for ch in entry):
            return [table[ch] for ch in entry]
        return list(self.text(token_id).encode("utf-8"))


def completion_logprobs(texts: TokenTexts, token_ids: list[int],
                        lps: list[TokenLogprob | None], text_offset: int = 0) -> CompletionLogprobs:
    """`lps[i]` is token_ids[i]'s (None for echo's first prompt token, which has none)."""
    out = CompletionLogprobs()
    offset = text_offset
    for tid, lp in zip(token_ids, lps, strict=True):
        s = texts.text(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top.setdefault(texts.text(t), v)  # two ids may decode alike: keep the likelier
        out.top_logprobs.append(top)
    return out


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=texts.text(lp.token_id), logprob=lp.logprob, bytes=texts.raw_bytes(lp.token_id),
            top_logprobs=[ChatTopLogprob(token=texts.text(t), logprob=v, bytes=texts.raw_bytes(t))
                          for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
        )
        for lp in lps
    ])
