"""Speculative decoding in the scheduler: who speculates, what it proposes, what it cost.

Pure Python, like the rest of the scheduler core. The proposer is prompt lookup (vLLM's
`ngram`): the request's last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`) are looked up in its own earlier tokens, prompt and output; the
tokens that followed their latest occurrence are the drafts. Each request keeps an index
of its n-grams, extended with the tokens that landed since its last proposal, so a
proposal costs a few dict lookups, not a scan of the context.

The drafts ride in the request's decode chunk (`ScheduledChunk.num_draft`): the batch
computes k + 1 rows for it and the worker verifies them greedily (the model's own choice
at each row, kept while it equals the next draft). `Scheduler.update_from_output` then
keeps the accepted run and rolls the rest back: `num_computed_tokens` returns to the
accepted tokens and the blocks past them go back to the pool. Nothing else ever saw the
drafts: a block is named in the prefix index, copied eagerly or rotated out as synced only
when its KV settled, and KV settles at landing, after the rollback.

Pipelined, a batch is planned while the one before it runs: a request whose last token is
still being sampled has no known suffix to look up. One that was copying from its context
(its known suffix matches) sits out that plan, so the next one proposes from its real last
token; and a batch that carries drafts lands before the next plan (engine_core.py), since
how far each request got decides that plan.

Part 1 is greedy only: a request with temperature > 0, penalties, a logit bias or a
grammar does not speculate, nor one that turned it off (`speculative: false`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.speculative import SpeculativeConfig
from scheduler_svc.request import Request


class NgramIndex:
    """One request's n-grams, n in [lo, hi]: each one's latest end (exclusive) in its tokens."""

    __slots__ = ("lo", "hi", "upto", "ends")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.upto = 0  # n-grams ending before this index are in `ends`
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}

    def _extend(self, seq: list[int]) -> None:
        """Index the n-grams ending before the last position: the suffix itself (ending at
        len(seq)) must not find itself."""
        end = len(seq)
        for e in range(max(self.upto, self.lo), end):
            for n in range(self.lo, min(self.hi, e) + 1):
                self.ends[n][tuple(seq[e - n : e])] = e
        self.upto = max(self.upto, end)

    def match(self, seq: list[int]) -> int | None:
        """Where the tokens after the latest earlier occurrence of seq's longest matching
        suffix start (None: no suffix of length lo..hi occurred before)."""
        self._extend(seq)
        end = len(seq)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            e = self.ends[n].get(tuple(seq[end - n :]))
            if e is not None:
                return e
        return None


@dataclass(slots=True)
class SpecStats:
    """vLLM's spec-decode counters (vllm:spec_decode_*)."""

    num_drafts: int = 0  # chunks that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at i

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def counters(self) -> dict[str, float]:
        """As GetStats sends them (gateway/metrics.py exports vLLM's names)."""
        d = {"spec_decode_num_drafts": float(self.num_drafts),
             "spec_decode_num_draft_tokens": float(self.num_draft_tokens),
             "spec_decode_num_accepted_tokens": float(self.num_accepted_tokens)}
        for i, n in enumerate(self.accepted_per_pos):
            d[f"spec_decode_num_accepted_tokens_per_pos:{i}"] = float(n)
        return d

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculator:
    """Prompt-lookup proposals for the scheduler, and what they yielded."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self._index: dict[str, NgramIndex] = {}
        self.stats = SpecStats()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Greedy, stateless sampling, and not turned off by the request."""
        s = req.sampling
        return req.speculative and s.greedy and not s.stateful

    def _tokens(self, req: Request) -> list[int]:
        return req.prompt_token_ids + req.output_token_ids

    def _index_of(self, req: Request) -> NgramIndex:
        ix = self._index.get(req.request_id)
        if ix is None:
            c = self.config
            ix = self._index[req.request_id] = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
        return ix

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(k, limit) drafts for a request whose last token is known."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        seq = self._tokens(req)
        at = self._index_of(req).match(seq)
        return [] if at is None else seq[at : at + limit]

    def copying(self, req: Request) -> bool:
        """Does the request's known suffix occur earlier (it is copying from its context)?"""
        return self._index_of(req).match(self._tokens(req)) is not None

    # -- what schedule_running asks (policy/state.py's Speculation) --------------------------
    def drafts(self, req: Request, limit: int) -> list[int]:
        if not self.eligible(req):
            return []
        return self.propose(req, min(limit, draft_limit(req, self.k)))

    def sits_out(self, req: Request) -> bool:
        return self.eligible(req) and draft_limit(req, self.k) > 0 and self.copying(req)

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def draft_limit(req: Request, k: int) -> int:
    """Drafts that can still be kept: the tokens after this step's first one stop at
    max_tokens and at the context."""
    left_out = req.sampling.max_tokens - len(req.output_token_ids) - 1
    left_ctx = req.max_model_len - req.num_tokens - 1
    return max(0, min(k, left_out, left_ctx))
