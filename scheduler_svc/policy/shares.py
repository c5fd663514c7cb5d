"""Fair shares across tenants: who holds the device when tenants contend.

Each tenant has a counter of the service it got, divided by its weight (the tenants
file's `weight`, sent with every request). Within a priority class (policy/priority.py):

* **Candidates** come tenant by tenant, always from the tenant whose counter is lowest,
  and within a tenant in the policy's own order (LVF's lag). A seat given in this
  iteration's walk counts at once (`seat`), so the walk interleaves tenants by weight.
* **Running requests** are ordered by their tenant's counter (lowest first, the policy's
  order within a tenant), so victims come from the tenant most over its share.
* **Preemption across tenants**: a running request may be displaced for a candidate of
  another tenant only where the victim's tenant is further over its share than the
  candidate's, by more than the candidate's seat will count (a tenant under its share is
  never preempted for one over it, and two tenants never trade a seat back and forth);
  within a tenant the policy decides. The mechanism's guards still hold (a victim's minimum
  residency, B_xfer).

Service is what Sheng et al.'s Virtual Token Counter (OSDI 2024) counts, prompt tokens
once and output tokens twice, charged as the tokens are scheduled, plus, under `shares`,
device memory: the block-seconds a tenant's running requests hold, converted to tokens at
the engine's measured rate (weighted tokens per second), so that holding the whole pool
for a second costs what computing at full speed for a second does. `vtc` counts tokens
only (the baseline that measures what the memory term is worth); `global` keeps no
counters (the policy's order across tenants, as before tenants).

No credit is banked: a tenant that had no live request and gets one starts at the
lowest counter among the tenants with work (never below its own), so idling earns
nothing, and the order is work-conserving (a tenant with no candidate takes no seat from
anyone). With one tenant, or none named, every order is the policy's own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

from scheduler_svc.policy.merge import merge
from scheduler_svc.queue import Entry
from scheduler_svc.request import Request

FAIRNESS = ("shares", "vtc", "global")
PROMPT_WEIGHT = 1.0  # VTC's w_p
OUTPUT_WEIGHT = 2.0  # VTC's w_q: an output token counts twice
RATE_EMA = 0.1  # the token rate follows the last ~10 iterations


class Ledger:
    """Per-tenant service (the counters), and what each tenant holds and got."""

    def __init__(self, mode: str, num_device_blocks: int) -> None:
        if mode not in FAIRNESS:
            raise ValueError(f"fairness must be one of {', '.join(FAIRNESS)}, got {mode!r}")
        self.mode = mode
        self.num_device_blocks = max(1, num_device_blocks)
        self.counter: dict[str, float] = {}  # service / weight
        self.weight: dict[str, float] = {}
        self.live: dict[str, int] = {}  # live requests per tenant (only those with some)
        self.tokens: dict[str, float] = {}  # prompt + output tokens scheduled (unweighted)
        self.block_s: dict[str, float] = {}  # device block-seconds held
        self.rate = 0.0  # weighted tokens per second the engine computes (EMA)
        self._provisional: dict[str, float] = {}  # seats of the walk in progress
        self._last: float | None = None  # when `charge` last ran

    # -- who has work ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """A live request arrives: a tenant that had none starts at the lowest counter of
        the tenants with work (no credit for its idle time)."""
        t = req.tenant
        self.weight[t] = req.weight
        n = self.live.get(t, 0)
        if not n:
            floor = min((self.counter[u] for u in self.live), default=None)
            own = self.counter.get(t, 0.0)
            self.counter[t] = own if floor is None else max(own, floor)
        self.live[t] = n + 1

    def remove(self, req: Request) -> None:
        n = self.live[req.tenant] - 1
        if n:
            self.live[req.tenant] = n
        else:
            del self.live[req.tenant]

    @property
    def contended(self) -> bool:
        """Do tenants compete right now (more than one with work, counters kept)?"""
        return self.mode != "global" and len(self.live) > 1

    @property
    def accounting(self) -> bool:
        """Is service being counted (a named tenant seen: a server with a tenants file, or
        a trace of several)? Without tenants nothing is, and nothing costs."""
        return len(self.counter) > 1 or "" not in self.counter and bool(self.counter)

    def key(self, tenant: str) -> float:
        """The tenant's place in the order now: lower goes first."""
        return self.counter.get(tenant, 0.0) + self._provisional.get(tenant, 0.0)

    # -- charging --------------------------------------------------------------------------
    def seat(self, req: Request, tokens: int) -> None:
        """The walk seats `req` for `tokens` tokens this iteration: count them now, so the
        next candidate comes from whoever is lowest then (`charge` replaces it)."""
        if self.contended:
            w = PROMPT_WEIGHT if req.num_computed_tokens < req.num_prompt_tokens else OUTPUT_WEIGHT
            self._provisional[req.tenant] = (self._provisional.get(req.tenant, 0.0)
                                             + w * tokens / self.weight.get(req.tenant, 1.0))

    def charge(self, now: float, planned: dict[str, int], requests: dict[str, Request],
               held: Iterable[tuple[str, int]], queued: Iterable[Request] = ()) -> None:
        """An iteration was planned at `now`: `planned` tokens per request id, `held`
        (tenant, device blocks) of every running request since the last plan, and the
        `queued` (waiting and rotary) requests, which blame the holders for that time."""
        self._provisional.clear()
        last, self._last = self._last, now
        if not self.accounting:
            return
        dt = 0.0 if last is None else max(0.0, now - last)
        weighted: dict[str, float] = {}
        total = 0.0
        for rid, n in planned.items():
            req = requests.get(rid)
            if req is None:
                continue
            prompt_left = max(0, req.num_prompt_tokens - (req.num_computed_tokens - n))
            w = PROMPT_WEIGHT * min(n, prompt_left) + OUTPUT_WEIGHT * max(0, n - prompt_left)
            weighted[req.tenant] = weighted.get(req.tenant, 0.0) + w
            self.tokens[req.tenant] = self.tokens.get(req.tenant, 0.0) + n
            total += w
        if dt > 0 and total > 0:
            self.rate = total / dt if not self.rate else (
                (1 - RATE_EMA) * self.rate + RATE_EMA * total / dt)
        blocks: dict[str, float] = {}
        for tenant, count in held:
            blocks[tenant] = blocks.get(tenant, 0.0) + count
        for tenant, b in blocks.items():
            self.block_s[tenant] = self.block_s.get(tenant, 0.0) + b * dt
        in_use = sum(blocks.values())
        if dt > 0 and in_use > 0:
            held_s = [(tenant, dt * b / in_use) for tenant, b in blocks.items() if b]
            for req in queued:
                blame = req.open_blame
                for tenant, s in held_s:
                    blame[tenant] = blame.get(tenant, 0.0) + s
        memory = self.mode == "shares" and self.rate > 0
        per_block_s = self.rate / self.num_device_blocks  # tokens a block-second is worth
        for tenant in set(weighted) | (set(blocks) if memory else set()):
            service = weighted.get(tenant, 0.0)
            if memory:
                service += blocks.get(tenant, 0.0) * dt * per_block_s
            if self.mode != "global":
                self.counter[tenant] = (self.counter.get(tenant, 0.0)
                                        + service / self.weight.get(tenant, 1.0))
            else:
                self.counter.setdefault(tenant, 0.0)

    # -- orders ----------------------------------------------------------------------------
    def by_tenant(self, order: list[Request]) -> list[Request]:
        """Running requests, the tenant most under its share first (each tenant's in the
        given order): victims, from the tail, come from the one most over it."""
        if not self.contended:
            return order
        # Stable: each tenant's requests keep their order; classes stay first.
        return sorted(order, key=lambda r: (r.priority, self.key(r.tenant)))

    def interleave(self, runs: list[list[Entry]],
                   key: Callable[[Request, float], tuple[object, ...]], now: float
                   ) -> Iterator[Request]:
        """One priority class's sorted runs (each of one tenant), tenant by tenant, the
        lowest counter first at every step, each tenant's in the policy's order."""
        tenants: dict[str, list[list[Entry]]] = {}
        for run in runs:
            if run:
                tenants.setdefault(run[0][2].tenant, []).append(run)
        if len(tenants) <= 1 or not self.contended:
            return merge([r for rs in tenants.values() for r in rs], key, now)
        return self._interleave({t: merge(rs, key, now) for t, rs in tenants.items()})

    def _interleave(self, streams: dict[str, Iterator[Request]]) -> Iterator[Request]:
        heap = [(self.key(t), t) for t in streams]
        heapq.heapify(heap)
        while heap:
            _, t = heapq.heappop(heap)
            req = next(streams[t], None)
            if req is None:
                continue
            yield req  # the walk may seat it (`seat` raises the tenant's key) or pass it
            heapq.heappush(heap, (self.key(t), t))

    def displaces(self, victim: Request, candidate: Request) -> bool | None:
        """Across tenants (None within one, or without contention: the policy decides):
        may `victim` go for `candidate`? Only where the victim's tenant stays ahead of the
        candidate's even once the candidate's seat is counted (its prompt left, or a
        token), so that the two never trade the seat back and forth."""
        if victim.tenant == candidate.tenant or not self.contended:
            return None
        left = candidate.num_prompt_tokens - candidate.num_computed_tokens
        cost = PROMPT_WEIGHT * left if left > 0 else OUTPUT_WEIGHT
        return (self.key(victim.tenant)
                > self.key(candidate.tenant) + cost / self.weight.get(candidate.tenant, 1.0))

    def shares(self) -> dict[str, dict[str, float]]:
        """Each tenant's share of the tokens and of the device block-seconds so far."""
        tok, mem = sum(self.tokens.values()), sum(self.block_s.values())
        return {t: {"tokens": self.tokens.get(t, 0.0) / tok if tok else 0.0,
                    "block_seconds": self.block_s.get(t, 0.0) / mem if mem else 0.0}
                for t in sorted(set(self.tokens) | set(self.block_s))}
