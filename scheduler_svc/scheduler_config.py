"""The scheduler's configuration, its counters, and the events an iteration's output makes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from common.contracts import TokenLogprob
from common.speculative import SpeculativeConfig
from scheduler_svc.request import FinishReason

# Eager D2H copies of full blocks per iteration in `serve` (DuplexKV; 0: off). The
# simulator sizes its own to the simulated link (superinfer/sim/engine.py).
EAGER_BLOCKS = 32


def tenant_key(key: str, tenant: str) -> str:
    """GetStats' key of a per-tenant statistic: the plain key for tenant "" (no tenants
    file), ``<key>@<tenant>`` for a named one; the gateway exports it with the label
    tenant="<tenant>" (tenant names never hold "@": common/tenants.py NAME_RE)."""
    return f"{key}@{tenant}" if tenant else key


@dataclass(slots=True)
class SchedulerConfig:
    num_device_blocks: int
    num_host_blocks: int = 0
    block_size: int = 16
    max_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 8192
    eager_budget_blocks: int = EAGER_BLOCKS  # background D2H copies per iteration (0: off)
    host_reserve_blocks: int = 0  # eager copies leave this many host blocks free
    # Planned one iteration ahead, its transfers beside the batch in flight (the pipelined
    # step): blocks of this iteration's rotate-outs are not reused before their copy is done.
    pipelined: bool = False
    # Automatic prefix caching (block_manager.py): full blocks named by their tokens are
    # shared between requests and stay cached in both tiers after their requests end.
    # `model_id` roots the names, so that KV of another model never matches.
    enable_prefix_caching: bool = False
    model_id: str = ""
    # Across tenants (policy/shares.py): "shares" (tokens and device memory, by weight),
    # "vtc" (tokens only, the baseline) or "global" (the policy's order across tenants).
    fairness: str = "shares"
    # Speculative decoding (--speculative-config; scheduler_svc/speculative.py). None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.num_device_blocks < 1:
            raise ValueError(f"need at least one device block, got {self.num_device_blocks}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_batched_tokens and max_num_seqs must be positive")
        if self.num_host_blocks < 0 or self.eager_budget_blocks < 0:
            raise ValueError("block counts must be >= 0")
        # A request must fit the device pool on its own, or once it outgrew it no amount of
        # preemption would let it run (it would preempt itself forever): like vLLM, the
        # context is capped by what the pool holds.
        self.max_model_len = min(self.max_model_len, self.num_device_blocks * self.block_size)


@dataclass(slots=True)
class SchedulerStats:
    iterations: int = 0
    rotations: int = 0  # rotate-outs to the host pool, of every tenant
    swap_in_blocks: int = 0
    swap_out_blocks: int = 0
    eager_blocks: int = 0
    freed_without_copy: int = 0  # device blocks released at rotate-out thanks to eager copies
    # Prefix cache, in tokens, at each admission of a waiting request (vLLM's counting): the
    # device tier is queried for all of its tokens, the host tier for those the device missed.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_queries: int = 0
    prefix_cache_host_hits: int = 0
    swap_in_cached_blocks: int = 0  # blocks a swap-in found cached on the device: no copy
    # Pipelined: admissions whose swap-ins wait for the batch in flight; they compute from
    # the batch after, so that the one they join does not wait for their copies.
    deferred_swap_ins: int = 0
    recomputes: int = 0
    preemptions: int = 0
    # ... of them, to give a running request the blocks its next tokens need (the rest:
    # for a candidate, by the policy's order)
    growth_preemptions: int = 0
    # ... and to seat a parked (rotary) request: a started request traded for another, which
    # buys the parked one its pace (TPOT) with the victim's stalled gap (per-gap TBT)
    parked_preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    decision_s_total: float = 0.0
    decision_s_max: float = 0.0
    # The rotations of each named tenant (the rest are tenant ""'s): for GetStats' export.
    tenant_rotations: dict[str, int] = field(default_factory=dict)

    def rotated(self, tenant: str) -> None:
        self.rotations += 1
        if tenant:
            self.tenant_rotations[tenant] = self.tenant_rotations.get(tenant, 0) + 1

    def as_dict(self) -> dict[str, float | int]:
        """The totals, over every tenant."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "tenant_rotations"}

    def counters(self) -> dict[str, float]:
        """As GetStats sends them: a named tenant's rotations under `tenant_key`, and
        tenant ""'s under the plain key, so that the keys sum to the total."""
        d = {k: float(v) for k, v in self.as_dict().items()}
        d["rotations"] -= sum(self.tenant_rotations.values())
        d.update({tenant_key("rotations", t): float(n) for t, n in self.tenant_rotations.items()})
        return d


@dataclass(slots=True)
class RequestEvent:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    # Echo: logprobs of the prompt tokens after those already published, in order.
    prompt_logprobs: list[TokenLogprob] | None = None
