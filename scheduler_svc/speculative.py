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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.speculative import SpeculativeConfig
from scheduler_svc.request import Request


class NgramIndex:
    """One request's n-grams, n in [lo, hi]: each one's latest end (exclusive) in its tokens."""

    __slots__ = ("lo", "hi", "upto", "ends")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.upto = 0  # n-grams ending before this index are in `ends`
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}

    def _extend(self, tokens: Callable[[int, int], list[int]], end: int) -> None:
        """Index the n-grams ending before the last position: the suffix itself (ending at
        `end`) must not find itself."""
        for e in range(max(self.upto, self.lo), end):
            for n in range(self.lo, min(self.hi, e) + 1):
                self.ends[n][tuple(tokens(e - n, e))] = e
        self.upto = max(self.upto, end)

    def match(self, tokens: Callable[[int, int], list[int]], end: int) -> int | None:
        """Where the tokens after the latest earlier occurrence of the longest matching
        suffix of tokens [0, end) start (None: no suffix of length lo..hi occurred
        before). `tokens(a, b)`: tokens [a, b), so that only the new n-grams and the
        suffix are read, never the whole context."""
        self._extend(tokens, end)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            e = self.ends[n].get(tuple(tokens(end - n, end)))
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


class Proposer(Protocol):
    """Where drafts come from: prompt lookup here; suffix decoding and a draft model
    later. Per request, from its known tokens (prompt and accepted output)."""

    def propose(self, req: Request, limit: int) -> list[int]:
        """At most `limit` tokens the request is likely to produce next (none: its
        context does not predict them)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is gone."""
        ...


class PromptLookup:
    """vLLM's `ngram`: the tokens after the latest earlier occurrence of the request's
    last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its own
    prompt and output; an n-gram index per request, extended as its tokens land."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._index: dict[str, NgramIndex] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        if limit <= 0:
            return []
        ix = self._index.get(req.request_id)
        if ix is None:
            ix = self._index[req.request_id] = NgramIndex(self.lo, self.hi)
        end = len(req.prompt_token_ids) + len(req.output_token_ids)
        at = ix.match(req.token_ids_slice, end)
        return [] if at is None else req.token_ids_slice(at, min(at + limit, end))

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class StepTimes:
    """What a batch of decodes (and drafts) costs the executor, by its rows: a moving
    average per row count. A CPU's matrix kernels work in blocks of rows, so a step's
    time rises in stairs (measured here: 8 rows 15 ms, 9 rows 20 ms; 3 rows 5 ms, 4 rows
    8.6 ms): a line fitted over rows would price the row that opens a new block like any
    other."""

    SMOOTH = 0.2  # weight of a new batch in its row count's average
    # A row count not seen in this many batches is unknown again: a time measured once,
    # badly (a thread tuner's trial, a busy neighbour), must not rule its drafts out for
    # good.
    STALE = 1000
    # At most one batch in this many verifies drafts only to measure an unknown row count
    # (each such batch may cost its requests more than it yields).
    EXPLORE_EVERY = 64

    def __init__(self) -> None:
        self.by_rows: dict[int, float] = {}
        self.seen: dict[int, int] = {}  # row count -> the batch that last had it
        self.batches = 0
        self._explored = -self.EXPLORE_EVERY  # the batch count at the last exploration

    def observe(self, rows: int, seconds: float) -> None:
        self.batches += 1
        old = self.by_rows.get(rows)
        if old is None or self.batches - self.seen[rows] > self.STALE:
            self.by_rows[rows] = seconds
        else:
            self.by_rows[rows] = old + self.SMOOTH * (seconds - old)
        self.seen[rows] = self.batches

    def known(self, rows: int) -> float | None:
        t = self.by_rows.get(rows)
        return t if t is not None and self.batches - self.seen[rows] <= self.STALE else None

    def bounds(self, rows: int) -> tuple[float | None, float | None]:
        """An unknown row count's time lies between the nearest smaller and the nearest
        larger counts known (more rows never run faster); None where there is none."""
        known = [(r, t) for r in self.by_rows if (t := self.known(r)) is not None]
        lower = max(((r, t) for r, t in known if r < rows), default=None)
        upper = min(((r, t) for r, t in known if r > rows), default=None)
        return (lower[1] if lower else None), (upper[1] if upper else None)

    def can_explore(self) -> bool:
        return self.batches - self._explored >= self.EXPLORE_EVERY

    def may_explore(self) -> bool:
        """Take this batch's chance to measure an unknown row count, if it has one."""
        if not self.can_explore():
            return False
        self._explored = self.batches
        return True

@dataclass(slots=True)
class Guess:
    """A proposal a request was not given, checked against its tokens as they land."""

    tokens: list[int]
    matched: int = 0  # its leading tokens that came true so far


class Speculator:
    """Prompt-lookup proposals for the scheduler, how many of them a batch verifies, and
    what they yielded.

    A draft yields a token only if it and every draft before it are accepted, and its row
    costs the batch what the step times say. Each request keeps its acceptance rate β
    (decayed counts, starting from the server's rate so far): its j-th draft pays off with
    probability β^j. Each iteration (`begin`) the speculator proposes for the running
    requests whose last token is known, ranks every draft by that probability and keeps
    the first D, D chosen to maximise the batch's expected tokens per second,
    (n + Σ β^j) / t(n + D): one stream on a CPU, whose fixed cost per step dwarfs a row's,
    verifies drafts wherever its context predicts the output; a batch at the edge of a
    tile of rows verifies none unless they are near-certain; open chat, whose short
    n-grams recur by chance, stops drafting as its rate falls.
    """

    PRIOR_DRAFTS = 2.0  # weight of the prior in a request's acceptance rate, in drafts
    DECAY = 0.8  # per verification: a request's rate follows its recent drafts
    UNKNOWN_RATE = 0.7  # the prior before the server has verified any draft

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: Proposer = PromptLookup(config.prompt_lookup_min,
                                               config.prompt_lookup_max)
        self._rate: dict[str, list[float]] = {}  # request -> [accepted, proposed], decayed
        self.steps = StepTimes()
        self._planned: dict[str, list[int]] = {}  # this iteration's drafts, by request
        # Proposals a request was not given, still being checked against its tokens as
        # they land (the part not checked yet), and how many matched so far: evidence of
        # its rate that costs no row.
        self._shadow: dict[str, Guess] = {}
        self._worth_one = 1.0  # this iteration: the rate at which one draft pays
        # This iteration: the requests whose last token is in flight and whose known
        # suffix occurs earlier (they copy from their context).
        self._copying: set[str] = set()
        self.stats = SpecStats()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Greedy, stateless sampling, and not turned off by the request."""
        s = req.sampling
        return req.speculative and s.greedy and not s.stateful

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(k, limit) drafts for a request whose last token is known."""
        return self.proposer.propose(req, min(self.k, limit))

    def rate(self, request_id: str) -> float:
        r = self._rate.get(request_id)
        if r is None:
            s = self.stats
            return s.acceptance_rate if s.num_draft_tokens else self.UNKNOWN_RATE
        return r[0] / r[1]

    # -- planning -------------------------------------------------------------------------------
    def begin(self, running: Sequence[Request]) -> None:
        """Plan this iteration's drafts for the running requests (the batch's decodes)."""
        self._planned = {}
        self._copying = set()
        n = len(running)
        if not n:
            return
        steps = self.steps
        base = steps.known(n)
        one = steps.known(n + 1) or steps.bounds(n + 1)[1]
        # Pipelined: a request whose last token is in flight sits out when one draft at
        # its rate would pay (the next plan proposes from that token).
        if base is None and steps.batches:
            self._worth_one = float("inf")  # no draft is verified before a plain step ran
        elif base is None or one is None:
            # A draft is verified to learn what its row costs (as often as one may be).
            self._worth_one = 0.0 if base is None or steps.can_explore() else float("inf")
        else:
            self._worth_one = n * max(0.0, one / base - 1.0)
        offers: list[tuple[float, str, int]] = []  # (probability, request, depth)
        proposals: dict[str, list[int]] = {}
        shadow = self._shadow
        copying = self._copying
        for req in running:
            if not self.eligible(req):
                continue
            rid = req.request_id
            if req.num_placeholders:
                # Its last token is in flight: what its known suffix predicts, from that
                # token on, is checked against the tokens as they land (free evidence),
                # and it is copying from its context (sits_out).
                guess = self.propose(req, self.k)
                if guess:
                    copying.add(rid)
                    if rid not in shadow:
                        shadow[rid] = Guess(guess)
                continue
            drafts = self.propose(req, draft_limit(req, self.k))
            if not drafts:
                continue
            proposals[rid] = drafts
            beta, p = self.rate(req.request_id), 1.0
            for j in range(1, len(drafts) + 1):
                p *= beta
                offers.append((p, req.request_id, j))
        if not offers:
            return
        offers.sort(key=lambda o: -o[0])
        if not steps.batches:  # no step measured at all (no executor times): verify all
            best_d = len(offers)
        elif base is None:  # a plain step measures this batch size first
            best_d = 0
        else:
            best_d, best, expected = 0, n / base, 0.0
            for d, (p, _, _) in enumerate(offers, 1):
                expected += p
                t = steps.known(n + d)
                if t is None:
                    lower, upper = steps.bounds(n + d)
                    if lower is not None and (n + expected) / lower <= best:
                        continue  # cannot pay even at the fastest it might run
                    if steps.may_explore():  # verify them, and measure this many rows
                        best_d = d
                        break
                    if upper is None:
                        continue
                    t = upper
                if (n + expected) / t > best:
                    best_d, best = d, (n + expected) / t
        depth: dict[str, int] = {}
        for _, rid, j in offers[:best_d]:
            depth[rid] = max(depth.get(rid, 0), j)
        self._planned = {rid: proposals[rid][:j] for rid, j in depth.items()}
        for rid, drafts in proposals.items():
            if rid not in depth and rid not in shadow:
                shadow[rid] = Guess(drafts)  # not verified: checked as its tokens land

    def observe(self, rows: int, seconds: float) -> None:
        """A batch with no prompt tokens (decodes, and drafts) took `seconds`."""
        self.steps.observe(rows, seconds)

    # -- what schedule_running asks (policy/state.py's Speculation) --------------------------
    def drafts(self, req: Request, limit: int) -> list[int]:
        planned = self._planned.get(req.request_id)
        return planned[:max(0, limit)] if planned else []

    def sits_out(self, req: Request) -> bool:
        return (self.eligible(req) and draft_limit(req, self.k) > 0
                and self.rate(req.request_id) > self._worth_one
                and req.request_id in self._copying)

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        """A request's drafts were verified: count them, and update its rate."""
        self.stats.record(proposed, accepted)
        self._shadow.pop(request_id, None)
        self._learn(request_id, proposed, accepted)

    def landed(self, request_id: str, tokens: Sequence[int]) -> None:
        """Tokens of a request landed without verification: a proposal it was not given
        (a shadow) is scored against them, as verification would have scored it."""
        g = self._shadow.get(request_id)
        if g is None:
            return
        for tok in tokens:
            if tok != g.tokens[g.matched]:
                break
            g.matched += 1
            if g.matched == len(g.tokens):
                break
        else:
            return  # still coming true: the next tokens go on checking it
        del self._shadow[request_id]
        self._learn(request_id, len(g.tokens), g.matched)

    def _learn(self, request_id: str, proposed: int, accepted: int) -> None:
        r = self._rate.get(request_id)
        if r is None:
            prior = self.rate(request_id)
            r = self._rate[request_id] = [prior * self.PRIOR_DRAFTS, self.PRIOR_DRAFTS]
        r[0] = r[0] * self.DECAY + accepted
        r[1] = r[1] * self.DECAY + proposed

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self._rate.pop(request_id, None)
        self._shadow.pop(request_id, None)


def draft_limit(req: Request, k: int) -> int:
    """Drafts that can still be kept: the tokens after this step's first one stop at
    max_tokens and at the context."""
    left_out = req.sampling.max_tokens - len(req.output_token_ids) - 1
    left_ctx = req.max_model_len - req.num_tokens - 1
    return max(0, min(k, left_out, left_ctx))
