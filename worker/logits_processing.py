"""The sampling math between the forward pass and the choice of tokens: penalties, logit
bias, grammar masks, and logprobs.

Pure, batched functions over a logits tensor [S, V] (one row per sampled request) and
per-row parameters held as tensors (`LogitsParams`): no Python loop over rows' tokens or
over the vocabulary. A sampler calls `process()` once, on the raw logits, before it
applies temperature / top-k / top-p and chooses tokens, and `token_logprobs()` on the raw
logits for the rows that asked for logprobs (vLLM's default: logprobs of the model's own
distribution, before penalties, bias and masks). Echo's prompt logprobs are
`token_logprobs()` over the extra rows the forward pass returned.

Definitions (vLLM's, which OpenAI's API documents in words):
* repetition penalty r (> 0): a token seen in the prompt or the output so far has its
  logit divided by r when positive, multiplied by r when not;
* frequency penalty f: minus f times the token's count in the output so far;
* presence penalty p: minus p once if the token occurs in the output so far;
* logit bias: a per-token value added to the logit (OpenAI: -100 bans, 100 forces);
* a grammar mask: tokens the grammar does not allow next get -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from common.contracts import ExecuteResult, ScheduledChunk, TokenLogprob

NEG_INF = float("-inf")


def _empty_long() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long)


def _empty_float() -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32)


@dataclass(slots=True)
class LogitsParams:
    """Per-row parameters of one batch. Each part lists only the rows it touches."""

    # Penalties, rows [P]: output tokens [P, Lo] and prompt tokens [P, Lp], padded with -1.
    penalty_rows: torch.Tensor = field(default_factory=_empty_long)
    output_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.long))
    prompt_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.long))
    presence: torch.Tensor = field(default_factory=_empty_float)  # [P]
    frequency: torch.Tensor = field(default_factory=_empty_float)  # [P]
    repetition: torch.Tensor = field(default_factory=_empty_float)  # [P]
    # Logit bias as flat (row, token, value) triplets [B].
    bias_rows: torch.Tensor = field(default_factory=_empty_long)
    bias_ids: torch.Tensor = field(default_factory=_empty_long)
    bias_values: torch.Tensor = field(default_factory=_empty_float)
    # Grammar masks, rows [G]: a bitmask [G, ceil(V / 32)] int32, bit j of word w = token
    # 32 w + j allowed (the layout llguidance and xgrammar fill).
    mask_rows: torch.Tensor = field(default_factory=_empty_long)
    bitmask: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.int32))

    @property
    def empty(self) -> bool:
        return not (len(self.penalty_rows) or len(self.bias_rows) or len(self.mask_rows))

    def to(self, device: torch.device) -> LogitsParams:
        """The same parameters on `device` (the logits' device: the GPU worker's)."""
        if device.type == "cpu" or self.empty:
            return self
        return LogitsParams(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pad_rows(rows: list[list[int]]) -> torch.Tensor:
    """Token id lists as one [len(rows), longest] tensor padded with -1."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [R, L] padded with -1 -> counts [R, V] float32 (how often each token occurs)."""
    rows = ids.shape[0]
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=ids.device)
    if ids.numel():
        # Padding goes to the spare column V, dropped below.
        idx = torch.where(ids < 0, torch.full_like(ids, vocab_size), ids)
        counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor, rows: torch.Tensor, output_ids: torch.Tensor, prompt_ids: torch.Tensor,
    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
) -> torch.Tensor:
    """logits [S, V]; the penalties of `rows` [P] applied (a new tensor)."""
    if not len(rows):
        return logits
    V = logits.shape[1]
    x = logits[rows]  # [P, V]
    out_counts = token_counts(output_ids, V)
    seen_out = out_counts > 0
    seen = seen_out | (token_counts(prompt_ids, V) > 0)
    rep = repetition[:, None].expand_as(x)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency[:, None] * out_counts - presence[:, None] * seen_out.float()
    out = logits.clone()
    out[rows] = x
    return out


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """Add values[i] to logits[rows[i], ids[i]] (a new tensor)."""
    if not len(rows):
        return logits
    return logits.index_put((rows, ids), values.to(logits.dtype), accumulate=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 -> [G, V] bool, True = allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1  # [G, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor,
                     bitmask: torch.Tensor) -> torch.Tensor:
    """Tokens a row's grammar does not allow get -inf (a new tensor). A row whose mask
    allows nothing is left as it is: the caller's grammar is broken, not the model."""
    if not len(rows):
        return logits
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    none = ~allowed.any(dim=1)
    allowed[none] = True
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, NEG_INF)
    return out


def process(logits: torch.Tensor, p: LogitsParams) -> torch.Tensor:
    """Raw logits [S, V] -> the logits to sample from: penalties, then bias, then masks
    (vLLM's order; temperature and top-k/top-p come after, in the sampler)."""
    if p.empty:
        return logits
    x = apply_penalties(logits, p.penalty_rows, p.output_ids, p.prompt_ids, p.presence,
                        p.frequency, p.repetition)
    x = apply_logit_bias(x, p.bias_rows, p.bias_ids, p.bias_values)
    return apply_token_mask(x, p.mask_rows, p.bitmask)


@dataclass(slots=True)
class Logprobs:
    """Logprobs of R rows: the given token's, and the k most likely tokens (ids, logprobs)."""

    token_ids: torch.Tensor  # [R]
    logprobs: torch.Tensor  # [R]
    top_ids: torch.Tensor  # [R, k]
    top_logprobs: torch.Tensor  # [R, k]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> Logprobs:
    """logits [R, V] (raw), tokens [R] -> their logprobs and the top-k of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, tokens[:, None].long())[:, 0]
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        top_lp, top_ids = top.values, top.indices
    else:
        top_lp = torch.empty(lp.shape[0], 0, device=lp.device)
        top_ids = torch.empty(lp.shape[0], 0, dtype=torch.long, device=lp.device)
    return Logprobs(tokens.long(), own, top_ids, top_lp)


def _rows(lp: Logprobs, ks: list[int]) -> list[TokenLogprob]:
    ids, own = lp.token_ids.tolist(), lp.logprobs.tolist()
    tids, tlps = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    return [TokenLogprob(ids[i], own[i], tids[i][:k], tlps[i][:k]) for i, k in enumerate(ks)]


def sampled_logprobs(raw: torch.Tensor, samplers: Sequence[ScheduledChunk],
                     tokens: list[int]) -> dict[str, TokenLogprob]:
    """raw: the sampled rows' logits [S, V] (before processing), tokens: what each chose.
    The logprobs of the rows that asked for them (chunk.logprobs >= 0), by request id."""
    want = [i for i, c in enumerate(samplers) if c.logprobs >= 0]
    if not want:
        return {}
    ks = [samplers[i].logprobs for i in want]
    idx = torch.tensor(want, device=raw.device)
    chosen = torch.tensor([tokens[i] for i in want], device=raw.device)
    rows = _rows(token_logprobs(raw.index_select(0, idx), chosen, max(ks)), ks)
    return {samplers[i].request_id: r for i, r in zip(want, rows, strict=True)}


def prompt_logprobs(extra: torch.Tensor, chunks: Sequence[ScheduledChunk]
                    ) -> dict[str, list[TokenLogprob]]:
    """Echo: extra holds, in chunk order, one logits row per prompt logprob target of each
    chunk that has them (the rows the forward pass returns after the sampled ones)."""
    out: dict[str, list[TokenLogprob]] = {}
    row = 0
    for c in chunks:
        n = len(c.prompt_logprob_targets)
        if not n:
            continue
        k = max(c.logprobs, 0)
        targets = torch.tensor(c.prompt_logprob_targets, device=extra.device)
        out[c.request_id] = _rows(token_logprobs(extra[row : row + n], targets, k), [k] * n)
        row += n
    return out


def verify_drafts(rows: torch.Tensor, chunks: Sequence[ScheduledChunk],
                  first: dict[str, int], result: ExecuteResult) -> None:
    """Greedy verification of the speculative chunks' drafts. `rows`: their draft rows'
    raw logits, in chunk order (row j of a chunk follows its draft j); `first`: the token
    each sampled at its last known token. A draft is accepted while it equals the model's
    own choice at the row before it; each accepted draft's row gives one more token."""
    spec = [c for c in chunks if c.num_draft]
    if not spec:
        return
    choice = rows.argmax(dim=-1).tolist()
    at = 0
    for c in spec:
        k, rid = c.num_draft, c.request_id
        if c.stateful or not (c.temperature == 0.0 or c.top_k == 1):
            raise ValueError(f"{rid}: drafts are verified greedily, for requests without "
                             "penalties, bias or grammar (the scheduler sends no others)")
        drafts = c.token_ids[-k:]
        prev, kept = first[rid], []
        for j in range(k):
            if prev != drafts[j]:
                break
            prev = choice[at + j]
            kept.append(prev)
        if kept:
            result.accepted[rid] = kept
            if c.logprobs >= 0:
                lp = token_logprobs(rows[at : at + len(kept)], torch.tensor(kept), c.logprobs)
                result.accepted_logprobs[rid] = _rows(lp, [c.logprobs] * len(kept))
        at += k


def batch_result(logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
                 samplers: Sequence[ScheduledChunk], tokens: list[int],
                 execute_s: float) -> ExecuteResult:
    """A runner's answer for one batch: what each sampling chunk chose, the drafts it
    verified, and the logprobs asked for. `logits`: the forward pass's rows (the sampled
    ones, then echo's, then the draft rows), raw."""
    n = len(samplers)
    sampled = {c.request_id: t for c, t in zip(samplers, tokens, strict=True)}
    result = ExecuteResult(
        sampled=sampled,
        execute_s=execute_s,
        logprobs=sampled_logprobs(logits[:n], samplers, tokens),
        prompt_logprobs=prompt_logprobs(logits[n:], chunks),
    )
    drafted = sum(c.num_draft for c in chunks)
    if drafted:
        verify_drafts(logits[len(logits) - drafted :], chunks, sampled, result)
    return result
