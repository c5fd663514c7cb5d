"""A token-level KV checker for scheduler tests that need no model.

`CheckingExecutor` stores, in each device block slot, the token id whose KV would be
there, and before sampling reads the request's whole context back through its block
table. Any wrong block table, lost copy or race between transfers shows up as a context
that differs from the request's tokens. The next token is a deterministic function of
the context, so a correct engine produces the same tokens under any schedule — and the
checker knows every request's whole token sequence from its prompt alone, whichever of
its batches landed (a pipelined batch may run and then be given up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan
from scheduler_svc.request import RequestState

if TYPE_CHECKING:
    from scheduler_svc.interfaces import SchedulerOutput
    from scheduler_svc.scheduler import Scheduler

VOCAB = 1000
EMPTY = -1


def next_token(context: list[int]) -> int:
    h = 7
    for t in context[-8:]:
        h = (h * 31 + t) % 1_000_003
    return (h + len(context)) % VOCAB


class KVStore:
    def __init__(self, num_device: int, num_host: int, block_size: int) -> None:
        self.bs = block_size
        self.device = [[EMPTY] * block_size for _ in range(num_device)]
        self.host = [[EMPTY] * block_size for _ in range(num_host)]
        self.transfers = 0
        self.blocks_moved = 0
        self.log: list[tuple[int, int]] = []  # filled by tests: (swap-in blocks, requests)

    def transfer(self, plan: TransferPlan) -> None:
        self.transfers += 1
        read = {d for d, _ in plan.swap_out + plan.eager}
        written = {d for _, d in plan.swap_in}
        if read & written:
            raise AssertionError(f"fence {plan.fence}: device blocks {read & written} are "
                                 "read by D2H and written by H2D in the same batch")
        host_written = {h for _, h in plan.swap_out + plan.eager}
        host_read = {h for h, _ in plan.swap_in}
        if host_written & host_read:
            raise AssertionError(f"fence {plan.fence}: host blocks written and read at once")
        for d, h in plan.swap_out + plan.eager:
            self.host[h] = list(self.device[d])
        for h, d in plan.swap_in:
            self.device[d] = list(self.host[h])
        self.blocks_moved += plan.num_blocks


class CheckingExecutor:
    """`model`: the next token as a function of the context (default `next_token`).
    A chunk with drafts (speculative decoding) is checked up to its last known token and
    verified as the worker does: a draft is accepted while it equals the model's token."""

    def __init__(self, store: KVStore, prompts: dict[str, list[int]],
                 model: Callable[[list[int]], int] = next_token) -> None:
        self.store = store
        self.prompts = prompts  # request_id -> prompt, kept by the test
        self.model = model
        self._tokens: dict[str, list[int]] = {}  # request_id -> prompt + its continuation

    def tokens(self, request_id: str, n: int) -> list[int]:
        """The first n tokens (prompt, then output) a correct engine gives the request."""
        seq = self._tokens.setdefault(request_id, list(self.prompts[request_id]))
        while len(seq) < n:
            seq.append(self.model(seq))
        return seq[:n]

    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        bs = self.store.bs
        result = ExecuteResult(sampled={})
        for c in chunks:
            for i, tok in enumerate(c.token_ids):
                p = c.start_pos + i
                self.store.device[c.block_table[p // bs]][p % bs] = tok
        for c in chunks:
            end = c.start_pos + len(c.token_ids) - c.num_draft  # the known tokens' end
            ctx = [self.store.device[c.block_table[p // bs]][p % bs] for p in range(end)]
            if ctx != self.tokens(c.request_id, end):
                raise AssertionError(f"{c.request_id}: KV context differs from its tokens")
            if c.sample:
                tok = result.sampled[c.request_id] = self.model(ctx)
                kept: list[int] = []
                for draft in c.token_ids[len(c.token_ids) - c.num_draft:]:
                    if draft != tok:
                        break
                    ctx.append(draft)
                    tok = self.model(ctx)
                    kept.append(tok)
                if kept:
                    result.accepted[c.request_id] = kept
        return result


def assert_synced_blocks_hold_their_tokens(sched: Scheduler, store: KVStore,
                                           checker: CheckingExecutor) -> None:
    """Between steps: every synced block of a live request (its KV final: what a prefix
    name, an eager copy or a rotation may take), on the device and its host copy, and
    every block named in the prefix index, holds exactly the request's own tokens, never
    a rejected draft."""
    bm, bs = sched.bm, sched.config.block_size
    for rid, req in sched.requests.items():
        t = bm.tables.get(rid)
        if t is None:
            continue
        synced = min(req.num_settled_tokens // bs, len(t.device))
        truth = checker.tokens(rid, synced * bs)
        for i in range(len(t.device)):
            want = truth[i * bs:(i + 1) * bs]
            d, h = t.device[i], t.host[i]
            named = (d is not None and d in bm.dev_cache.hash_of) or (
                h is not None and h in bm.host_cache.hash_of)
            if i >= synced:
                if named or (h is not None and req.state is RequestState.RUNNING):
                    raise AssertionError(f"{rid}: block {i} is named or copied before its "
                                         "KV is final")
                continue
            if d is not None and store.device[d] != want:
                raise AssertionError(f"{rid}: synced device block {i} holds {store.device[d]}, "
                                     f"not its tokens {want}")
            if h is not None and store.host[h] != want:
                raise AssertionError(f"{rid}: host copy of block {i} holds {store.host[h]}, "
                                     f"not its tokens {want}")


def assert_writes_private(sched: Scheduler, out: SchedulerOutput) -> None:
    """Right after planning: every block a chunk writes belongs to its request alone and
    has no name in the prefix cache (a shared or cached block is never written)."""
    bm, bs = sched.bm, sched.config.block_size
    for c in out.chunks:
        first, last = c.start_pos // bs, (c.start_pos + len(c.token_ids) - 1) // bs
        for d in c.block_table[first:last + 1]:
            if d in bm.dev_cache.hash_of or bm._dev_ref[d] != 1:
                raise AssertionError(f"{c.request_id} writes device block {d}, which is "
                                     f"shared ({bm._dev_ref[d]} references) or cached")
