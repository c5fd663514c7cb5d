"""Grammar matchers and their token bitmasks (structured outputs), on llguidance.

One `GrammarBank` per worker: the library's view of the tokenizer (built once, ~0.7 s for
the bundled 49,152-token vocabulary), a cache of compiled grammars (200 requests with one
schema compile it once: a new matcher is a copy of the cached one), and a thread pool that
fills many rows' masks at once with the GIL released.
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import structlog
import torch

from common import grammar as grammar_text
from common.contracts import Grammar
from common.tokenizer import Tokenizer

CACHE_SIZE = 64  # distinct grammars kept compiled

log = structlog.get_logger()


class GrammarBank:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_ids)
        self._compiled: OrderedDict[Grammar, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()

    def matcher(self, g: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `g`. One that failed to compile (the scheduler
        checks grammars first, so only a library limit could do it) is in an error state,
        whose mask allows only EOS: the request ends instead of the batch failing."""
        m = self._compiled.get(g)
        if m is None:
            m = llguidance.LLMatcher(self._tokenizer, grammar_text.to_library(g), log_level=0)
            if m.is_error():
                log.warning("grammar_failed", kind=g.kind, error=m.get_error())
                return m
            self._compiled[g] = m
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(g)
        return m.deep_copy()

    def bitmask(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The next-token masks of `matchers`, one row each: [G, ceil(V / 32)] int32.

        Filled by the library's executor straight into the tensor (what `llguidance.torch`
        does; that module is not imported: its `torch.compile` decorator loads inductor,
        ~5 s of every worker's start, for a mask apply we do in logits_processing)."""
        words = (self.vocab_size + 31) // 32
        out = torch.full((len(matchers), words), -1, dtype=torch.int32)
        if matchers:
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], out.data_ptr(), words * 4, len(matchers))
        return out
