"""Cost models that stand in for the worker (iteration time) and kvmem (transfer time).

Execution (a roofline per iteration):

    t = overhead + max(FLOPs / (peak · MFU), bytes / (HBM bandwidth · efficiency))

    FLOPs = 2 · active_params · batch_tokens + 2 · lm_head · sampled_tokens
            + 4 · layers · q_heads · head_dim · Σ_chunks Σ_tokens (context seen by the token)
    bytes = weights read once (MoE: the experts at least one token routes to, expected)
            + KV of every chunk's whole context (read) and new tokens (written)

A profile with `attention_kv_Bps` (cpu-local) moves the KV bytes out of the roofline into a
pass of their own, added to it: `t = overhead + max(FLOPs/F, weights/B) + KV / attention_kv_Bps`.
On the CPU engine attention gathers each request's KV through its block table after the
matmuls, with no overlap, at a rate far below DRAM bandwidth (calibrate measures it).

Transfers (DESIGN 2 and 5): a block-first block is one segment of
layers·2·block_size·kv_heads·head_dim·dtype bytes, and adjacent blocks coalesce into one
copy issued in one batched call; a layer-first block is 2·layers separate segments of
block_size·kv_heads·head_dim·dtype bytes, each its own copy (vLLM 0.6's loop). A direction
takes Σ segment / bandwidth(segment) + copies · launch. Both directions at once (duplex)
take the slower direction, but no less than both byte counts over the shared DRAM limit;
one direction at a time (half duplex) takes the sum. A batch that copies anything also
pays the link's fixed `plan_overhead_s` (0 on the GPU profiles; on cpu-local the measured
Transfer RPC to kvmem, which the scheduler awaits before it executes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from common.contracts import ScheduledChunk, TransferPlan
from superinfer.sim.profile import BandwidthCurve, HardwareProfile, ModelProfile

LAYOUTS = ("block-first", "layer-first")


@dataclass(slots=True)
class ExecBreakdown:
    seconds: float
    compute_s: float
    memory_s: float
    tokens: int
    attention_s: float = 0.0  # the separate KV pass (profiles with attention_kv_Bps)


class ExecutionCostModel:
    def __init__(self, hw: HardwareProfile, model: ModelProfile) -> None:
        self.overhead_s = hw.iteration_overhead_s
        self.flops_per_s = hw.peak_flops * hw.mfu
        self.bytes_per_s = hw.hbm_bandwidth_Bps * hw.hbm_efficiency
        self.attention_kv_Bps = hw.attention_kv_Bps
        self.linear_flops_per_token = 2.0 * model.active_params
        self.lm_head_flops = 2.0 * model.lm_head_params
        # QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per query head and layer.
        self.attn_flops_per_pair = 4.0 * model.num_layers * model.num_q_heads * model.head_dim
        self.kv_bytes_per_token = model.kv_bytes_per_token
        expert_bytes = model.expert_params * model.dtype_bytes
        self.dense_weight_bytes = model.weight_bytes - expert_bytes
        self.expert_bytes = expert_bytes
        self.expert_miss = 1.0 - model.experts_per_token / model.num_experts

    def weight_bytes_read(self, tokens: int) -> float:
        # With top-k routing spread evenly, an expert is idle for one token with probability
        # 1 - k/E, so the expected share of expert weights read for T tokens is 1 - (1-k/E)^T.
        if not self.expert_bytes:
            return self.dense_weight_bytes
        return self.dense_weight_bytes + self.expert_bytes * (1.0 - self.expert_miss**tokens)

    def breakdown(self, chunks: list[ScheduledChunk]) -> ExecBreakdown:
        if not chunks:
            return ExecBreakdown(0.0, 0.0, 0.0, 0)
        tokens = sampled = pairs = context = 0
        for c in chunks:
            n = len(c.token_ids)
            s = c.start_pos
            tokens += n
            pairs += n * s + n * (n + 1) // 2  # token at position p attends to p + 1 tokens
            context += s + n
            sampled += c.sample
        return self.shape_breakdown(tokens, sampled, pairs, context)

    def shape_breakdown(self, tokens: int, sampled: int, pairs: int, context: int) -> ExecBreakdown:
        """The cost of a batch described by its totals (see `breakdown`)."""
        flops = (
            self.linear_flops_per_token * tokens
            + self.lm_head_flops * sampled
            + self.attn_flops_per_pair * pairs
        )
        kv_bytes = self.kv_bytes_per_token * context
        compute_s = flops / self.flops_per_s
        if self.attention_kv_Bps is not None:
            memory_s = self.weight_bytes_read(tokens) / self.bytes_per_s
            attention_s = kv_bytes / self.attention_kv_Bps
            return ExecBreakdown(self.overhead_s + max(compute_s, memory_s) + attention_s,
                                 compute_s, memory_s, tokens, attention_s)
        memory_s = (self.weight_bytes_read(tokens) + kv_bytes) / self.bytes_per_s
        return ExecBreakdown(self.overhead_s + max(compute_s, memory_s), compute_s, memory_s,
                             tokens)

    def iteration_s(self, chunks: list[ScheduledChunk]) -> float:
        return self.breakdown(chunks).seconds


@dataclass(slots=True)
class TransferTime:
    critical_s: float  # swap-out + swap-in, on the iteration's critical path
    eager_s: float  # background D2H copies of synced blocks
    d2h_s: float
    h2d_s: float
    d2h_bytes: float
    h2d_bytes: float


def coalesced_runs(pairs: list[tuple[int, int]]) -> list[int]:
    """Lengths of the runs in which both source and destination block ids are consecutive."""
    if not pairs:
        return []
    ordered = sorted(pairs)
    runs = []
    k = 1
    ps, pd = ordered[0]
    for s, d in ordered[1:]:
        if s - ps == 1 and d - pd == 1:
            k += 1
        else:
            runs.append(k)
            k = 1
        ps, pd = s, d
    runs.append(k)
    return runs


class TransferCostModel:
    def __init__(
        self,
        hw: HardwareProfile,
        model: ModelProfile,
        block_size: int,
        layout: str = "block-first",
        duplex: bool = True,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        link = hw.link
        self.layout = layout
        self.duplex = duplex
        self.duplex_total_Bps = link.duplex_total_Bps
        self.block_bytes = model.block_bytes(block_size)
        self.d2h, self.h2d = link.d2h, link.h2d
        self.plan_overhead_s = link.plan_overhead_s
        if layout == "block-first":
            # DuplexKV: one segment per block, adjacent blocks merged, one batched call.
            self.segments_per_block = 1
            self.segment_bytes = self.block_bytes
            self.launch_s = link.batched_launch_overhead_s
            self.coalesce = True
        else:
            # vLLM 0.6: per layer, K and V each a separate copy per block.
            self.segments_per_block = 2 * model.num_layers
            self.segment_bytes = self.block_bytes // self.segments_per_block
            self.launch_s = link.launch_overhead_s
            self.coalesce = False
        self._run_cache: dict[tuple[int, int], float] = {}

    def _run_s(self, curve: BandwidthCurve, k: int) -> float:
        key = (id(curve), k)
        t = self._run_cache.get(key)
        if t is None:
            seg = k * self.segment_bytes
            t = self.segments_per_block * (seg / curve(seg) + self.launch_s)
            self._run_cache[key] = t
        return t

    def direction_s(self, pairs: list[tuple[int, int]], curve: BandwidthCurve) -> float:
        """Seconds to copy `pairs` (block id pairs) in one direction, alone on the link."""
        if not pairs:
            return 0.0
        if self.coalesce:
            return sum(c * self._run_s(curve, k) for k, c in Counter(coalesced_runs(pairs)).items())
        return len(pairs) * self._run_s(curve, 1)

    def blocks_s(self, n: int, direction: str = "d2h") -> float:
        """Seconds to move n scattered (uncoalesced) blocks one way."""
        curve = self.d2h if direction == "d2h" else self.h2d
        return n * self._run_s(curve, 1)

    def plan_time(self, plan: TransferPlan | None) -> TransferTime:
        if plan is None:
            return TransferTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        d2h_s = self.direction_s(plan.swap_out, self.d2h)
        h2d_s = self.direction_s(plan.swap_in, self.h2d)
        d2h_b = len(plan.swap_out) * self.block_bytes
        h2d_b = len(plan.swap_in) * self.block_bytes
        if self.duplex:
            critical = max(d2h_s, h2d_s, (d2h_b + h2d_b) / self.duplex_total_Bps)
        else:
            critical = d2h_s + h2d_s
        if plan.swap_out or plan.swap_in or plan.eager:
            critical += self.plan_overhead_s
        eager_s = self.direction_s(plan.eager, self.d2h)
        return TransferTime(critical, eager_s, d2h_s, h2d_s, d2h_b, h2d_b)


class ModelIterationCost:
    """The execution cost model as the scheduler's `IterationCost` (the oracle): a batch of
    `tokens` over `seqs` requests with `context` tokens of KV, every request sampling once
    and each new token attending to its request's whole context (decode-like)."""

    ready = True

    def __init__(self, model: ExecutionCostModel) -> None:
        self.model = model

    def seconds(self, tokens: int, seqs: int, context: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.model.shape_breakdown(tokens, seqs, context, context).seconds

    def observe(self, tokens: int, seqs: int, context: int, seconds: float) -> None:
        pass  # a model does not learn
