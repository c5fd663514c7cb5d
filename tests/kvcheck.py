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

from typing import TYPE_CHECKING

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan

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
    def __init__(self, store: KVStore, prompts: dict[str, list[int]]) -> None:
        self.store = store
        self.prompts = prompts  # request_id -> prompt, kept by the test
        self._tokens: dict[str, list[int]] = {}  # request_id -> prompt + its continuation

    def tokens(self, request_id: str, n: int) -> list[int]:
        """The first n tokens (prompt, then output) a correct engine gives the request."""
        seq = self._tokens.setdefault(request_id, list(self.prompts[request_id]))
        while len(seq) < n:
            seq.append(next_token(seq))
        return seq[:n]

    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        bs = self.store.bs
        sampled = {}
        for c in chunks:
            for i, tok in enumerate(c.token_ids):
                p = c.start_pos + i
                self.store.device[c.block_table[p // bs]][p % bs] = tok
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            ctx = [self.store.device[c.block_table[p // bs]][p % bs] for p in range(end)]
            if ctx != self.tokens(c.request_id, end):
                raise AssertionError(f"{c.request_id}: KV context differs from its tokens")
            if c.sample:
                sampled[c.request_id] = next_token(ctx)
        return ExecuteResult(sampled=sampled)


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
