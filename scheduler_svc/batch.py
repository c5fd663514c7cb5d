"""The batch an iteration sends to the worker, and what its output publishes.

A scheduled chunk counts as computed at once, and a chunk that samples adds a
placeholder token, so the next iteration can be planned while this one executes (the
pipelined step): its decodes carry `PLACEHOLDER`, which the worker fills in with the
token it sampled for that request in the batch before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from common.contracts import PLACEHOLDER, ExecuteResult, ScheduledChunk, TokenLogprob
from scheduler_svc.request import Request


class BlockTable(Protocol):
    device: list[int | None]


@dataclass(slots=True)
class Batch:
    chunks: list[ScheduledChunk]
    num_decode_tokens: int  # tokens that are decode steps (the rest: prefill)
    kv_epochs: dict[str, int]  # each request's kv_epoch, to settle its chunk against
    new_blocks_needed: int  # requests whose next token now starts a new block
    num_draft_tokens: int = 0  # drafts to verify (neither decode nor prefill)


def build_batch(tokens: Mapping[str, int], requests: Mapping[str, Request],
                tables: Mapping[str, BlockTable], bs: int,
                drafts: Mapping[str, list[int]] | None = None) -> Batch:
    """The batch for the worker: a chunk of `tokens[rid]` tokens per request, the last
    of them `drafts[rid]` where it speculates (scheduler_svc/speculative.py).

    The batch counts as computed (in flight) from now on: each request's chunk is
    advanced as it is built (drafts included, until verification rolls the rejected ones
    back), and a sampling chunk adds its placeholder token."""
    chunks: list[ScheduledChunk] = []
    decode = 0
    drafted = 0
    new_blocks = 0
    epochs: dict[str, int] = {}
    new_chunk = ScheduledChunk
    add = chunks.append
    for rid, n in tokens.items():  # one per request in the batch: kept lean
        req = requests[rid]
        start = req.num_computed_tokens
        proposed = drafts.get(rid) if drafts else None
        end = start + n - (len(proposed) if proposed else 0)  # the known tokens' end
        prompt, output = req.prompt_token_ids, req.output_token_ids
        p = len(prompt)
        known = p + len(output)
        if start >= p:
            ids = output[start - p : end - p]
        else:
            ids = prompt[start:end] if end <= p else prompt[start:] + output[: end - p]
        if end > known:  # the last token is being sampled in flight: the worker has it
            if end > known + 1:
                raise RuntimeError(f"{rid}: planned past its one token in flight")
            ids.append(PLACEHOLDER)
        placeholders = req.num_placeholders
        sample = end == known + placeholders  # the request's num_tokens
        # A decode step computes the one token sampled last iteration; anything else
        # (prompt chunks, recompute after preemption) counts as prefill.
        if end - start == 1 and sample and start >= p:
            decode += 1
        s = req.sampling
        # The live table (see ScheduledChunk); a running request holds every block
        # (no None in it: check_integrity checks it).
        chunk = new_chunk(rid, ids, start, tables[rid].device,  # type: ignore[arg-type]
                          sample, s.temperature, s.top_p, s.top_k, s.seed,
                          len(output) + placeholders)
        if req.chunk_extras:
            sampling_fields(req, chunk, end)
        if proposed:
            ids.extend(proposed)
            chunk.num_draft = len(proposed)
            drafted += len(proposed)
        add(chunk)
        # In flight from now on (len(ids) == n).
        req.num_computed_tokens = start + n
        req.num_inflight_tokens += n
        epochs[rid] = req.kv_epoch
        if sample:
            req.num_placeholders = placeholders = placeholders + 1
            if (known + placeholders) % bs == 0:
                new_blocks += 1  # the next token starts a new block
    return Batch(chunks, decode, epochs, new_blocks, drafted)


def sampling_fields(req: Request, c: ScheduledChunk, end: int) -> None:
    """What logprobs, echo, penalties, bias and grammar add to a chunk."""
    s = req.sampling
    c.logprobs = -1 if s.logprobs is None else s.logprobs
    p = req.num_prompt_tokens
    if s.prompt_logprobs and c.start_pos < p - 1:
        # Row of position q scores prompt token q + 1; the last prompt token's row
        # samples instead (its logprob is the first output token's).
        c.prompt_logprob_targets = req.prompt_token_ids[c.start_pos + 1 : min(end, p - 1) + 1]
    if c.sample and s.stateful:
        c.stateful = True
        c.presence_penalty = s.presence_penalty
        c.frequency_penalty = s.frequency_penalty
        c.repetition_penalty = s.repetition_penalty
        if not req.worker_state_sent:
            c.state = req.sampling_state()
            req.worker_state_sent = True


def new_prompt_logprobs(req: Request, chunk: ScheduledChunk,
                        result: ExecuteResult) -> list[TokenLogprob] | None:
    """Echo: the chunk's prompt logprobs not yet published (a recomputed chunk scores
    positions again; those went out the first time)."""
    lps = result.prompt_logprobs.get(chunk.request_id)
    if not lps:
        return None
    first = chunk.start_pos + 1  # the prompt token the chunk's first row scores
    skip = max(0, req.prompt_logprobs_sent + 1 - first)
    if first + skip != req.prompt_logprobs_sent + 1:
        return None  # not the next in order (cannot happen: chunks land in order)
    new = lps[skip:]
    req.prompt_logprobs_sent += len(new)
    return new or None
