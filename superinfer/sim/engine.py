"""The simulator: the real `Scheduler`, block manager and policy on a simulated clock.

Each iteration is the engine's own step (`scheduler_svc/engine_core.py`), serial or
pipelined as the engine runs it, with cost models in place of the worker and kvmem:

    schedule()                 the real scheduler, at the simulated time (takes no time)
    transfer(plan)             TransferCostModel: the plan's copies on the link (duplex:
                               both directions at once; else one after the other)
    execute(batch)             ExecutionCostModel (roofline), one batch at a time
    update_from_output()       one synthetic token per sampled chunk

The lanes take their time with `asyncio.sleep` on a simulated clock (`vclock.py`), so
whatever the step overlaps — the pipelined step plans t+1 and runs its copies while batch
t executes — overlaps here exactly as the engine does it.

Requests join when the clock passes their arrival; an idle engine jumps to the next
arrival. Requests run with ignore_eos and max_tokens = the trace's output length, or
(`lengths="unknown"`) with the context as max_tokens, ending by EOS at that length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config import EngineConfig, optional_float
from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan, TransferResult
from common.errors import SuperInferError
from common.scheduling import SchedulingSettings
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.interfaces import SchedulerInterface
from scheduler_svc.policy import POLICY_NAMES, RotationLimits, VLTParams, make_policy
from scheduler_svc.policy.iteration_cost import IterationCost, OnlineIterationCost
from scheduler_svc.policy.shares import FAIRNESS
from scheduler_svc.policy.xfer_budget import xfer_budget
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.scheduler_config import EAGER_BLOCKS
from superinfer.sim.cost import LAYOUTS, ExecutionCostModel, ModelIterationCost, TransferCostModel
from superinfer.sim.profile import HardwareProfile, ModelProfile
from superinfer.sim.vclock import VirtualClock
from superinfer.slo_metrics import RequestRecord, SLOMetrics, compute_metrics
from superinfer.workload import TraceRequest

AUTO = -1  # the eager budget: size to the link (see Simulator)
UNLIMITED = -1  # B_xfer: no bound (a what-if; the setting's None is "auto", as in serve)
LENGTHS = ("known", "unknown")  # SimConfig.lengths
EOS_TOKEN = 1  # what a request of unknown length samples last (token 0 before it)
_ENGINE = EngineConfig()


class SimulationError(SuperInferError):
    code = "simulation_error"
    http_status = 400


@dataclass(slots=True)
class SimConfig(SchedulingSettings):
    """The scheduling settings (common/scheduling.py, defaults and all) plus the simulated
    machine's, and the policy's rules (`vlt`, `limits`) for what-if studies.

    `xfer_budget_blocks` None is "auto", as in `serve`: what the link moves one way in
    50 ms (scheduler_svc/policy/xfer_budget.py), here from the link profile; UNLIMITED: no
    bound. The eager budget, which `serve` fixes at 32 blocks, is sized to the simulated
    link (AUTO) so that one default works from a CPU to a GH200. The simulator's traces
    carry no token ids, so `enable_prefix_caching` has nothing to match here.
    """

    block_size: int = _ENGINE.block_size
    # LVF's rules (their defaults are the engine's): the experiments vary them here.
    vlt: VLTParams = field(default_factory=VLTParams)
    limits: RotationLimits = field(default_factory=RotationLimits)
    cost: str = "online"  # what the scheduler knows of iteration times: online, model, none
    eager_budget_blocks: int = AUTO  # 0: no eager copies
    layout: str = "block-first"
    duplex: bool = True
    device_blocks: int | None = None  # None: from the profile's memory
    host_blocks: int | None = None
    max_sim_s: float | None = None  # stop the clock here (None: 10x the trace + 600 s)
    max_model_len: int | None = None  # None: the model profile's context
    # What the scheduler knows of each request's output length: "known" (the artifact's
    # and vLLM bench's: ignore_eos, max_tokens = the trace's length) or "unknown" (an
    # OpenAI client that sends no max_tokens: the bound is the context, and the request
    # ends by EOS at the trace's length).
    lengths: str = "known"
    # With unknown lengths, the max_tokens each request sends (an OpenAI client's, e.g.
    # `bench serve --no-ignore-eos --max-tokens 512`); None: bounded by the context alone.
    max_tokens: int | None = None
    # Across tenants (scheduler_svc/policy/shares.py): the engine's "shares", or the
    # baselines "vtc" (tokens only) and "global" (the policy's order across tenants).
    fairness: str = "shares"

    @classmethod
    def from_engine(cls, ec: EngineConfig, **overrides: Any) -> SimConfig:
        """The settings a `superinfer serve` with this EngineConfig schedules with (its
        eager budget too)."""
        values: dict[str, Any] = {
            f.name: getattr(ec, f.name) for f in dataclasses.fields(cls)
            if f.name in _ENGINE_FIELDS
        }
        values["eager_budget_blocks"] = EAGER_BLOCKS
        values.update(overrides)
        return cls(**values)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise SimulationError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.block_size < 1:
            raise SimulationError(f"--block-size must be positive, got {self.block_size}")
        try:
            self.check()
        except ValueError as e:
            if self.xfer_budget_blocks != UNLIMITED:
                raise SimulationError(str(e)) from None
        if self.eager_budget_blocks < AUTO:
            raise SimulationError(f"--eager-budget-blocks must be >= 0, got {self.eager_budget_blocks}")
        if self.lengths not in LENGTHS:
            raise SimulationError(f"--lengths must be one of {', '.join(LENGTHS)}, got {self.lengths!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SimulationError(f"max_tokens must be positive (None: the context), got {self.max_tokens}")
        if self.fairness not in FAIRNESS:
            raise SimulationError(f"fairness must be one of {', '.join(FAIRNESS)}, got "
                                  f"{self.fairness!r}")
        if self.cost not in ("online", "model", "none"):
            raise SimulationError(f"--iteration-cost must be online, model or none, got {self.cost!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SimulationError(f"max_model_len must be at least 2, got {self.max_model_len}")
        try:
            SLO(self.ttft_slo, self.tbt_slo)
        except ValueError as e:
            raise SimulationError(str(e)) from None


_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


# -- policy variants -----------------------------------------------------------------------
# key -> (where, field, kind): where is "vlt" or "limits" (the policy's rules) or "" (a
# SimConfig field: a setting or the simulated machine's).
_VARIANT_KEYS: dict[str, tuple[str, str, Any]] = {
    "alpha": ("vlt", "alpha", float),
    "beta_b": ("vlt", "beta_b", float),
    "beta_f": ("vlt", "beta_f", float),
    "stall": ("vlt", "max_stall", "optional_float"),
    "max_stall": ("vlt", "max_stall", "optional_float"),
    "xfer": ("", "xfer_budget_blocks", "xfer"),
    "min_res": ("limits", "min_residency", int),
    "adapt": ("limits", "adapt_residency", "bool"),
    "margin": ("limits", "vlt_margin", float),
    "hold": ("limits", "hold_vlt", "optional_float"),
    "tbt_budget": ("limits", "iteration_budget", "optional_float"),
    "prefill": ("limits", "prefill_within", float),
    "lazy": ("limits", "lazy_rotation", "bool"),
    "lazy_margin": ("limits", "lazy_margin", float),
    "parked_first": ("limits", "parked_first", "bool"),
    "park_cover": ("limits", "park_cover", "optional_float"),
    "cover": ("limits", "park_cover", "optional_float"),
    "growth_room": ("limits", "growth_room", float),
    "room": ("limits", "growth_room", float),
    "memory_margin": ("limits", "memory_margin", float),
    "cost": ("", "cost", str),
    "eager": ("", "eager_budget_blocks", "budget"),
    "layout": ("", "layout", str),
    "duplex": ("", "duplex", "bool"),
    "pipeline": ("", "pipeline", "bool"),
    "fairness": ("", "fairness", str),
}


def parse_xfer(text: str) -> int | None:
    """B_xfer in a policy spec: 'auto' -> None (the setting's auto), 'none' -> UNLIMITED."""
    t = text.strip().lower()
    if t == "auto":
        return None
    if t in ("none", "inf", "unlimited"):
        return UNLIMITED
    v = int(t)
    if v < 0:
        raise ValueError(v)
    return v


def parse_budget(text: str) -> int | None:
    """'auto' -> AUTO, 'none'/'inf' -> None (unlimited), else a block count."""
    t = text.strip().lower()
    if t == "auto":
        return AUTO
    if t in ("none", "inf", "unlimited"):
        return None
    try:
        v = int(t)
    except ValueError:
        raise SimulationError(f"a block budget is auto, none or a count, got {text!r}") from None
    if v < 0:
        raise SimulationError(f"a block budget must be >= 0, got {v}")
    return v


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "on", "true", "yes"):
        return True
    if t in ("0", "off", "false", "no"):
        return False
    raise SimulationError(f"expected on/off, got {text!r}")


@dataclass(slots=True, frozen=True)
class PolicyVariant:
    """A policy plus per-variant overrides of SimConfig: `lvf:xfer=300:layout=layer-first`."""

    policy: str
    label: str
    overrides: tuple[tuple[str, object], ...] = ()

    @classmethod
    def parse(cls, spec: str) -> PolicyVariant:
        parts = [p for p in spec.strip().split(":") if p]
        if not parts:
            raise SimulationError("empty policy name")
        name = parts[0]
        if name not in POLICY_NAMES:
            raise SimulationError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
        label = spec.strip()
        overrides: list[tuple[str, object]] = []
        for p in parts[1:]:
            key, sep, value = p.partition("=")
            if not sep:
                raise SimulationError(f"policy option {p!r} in {spec!r} is not key=value")
            if key == "label":
                label = value
                continue
            if key not in _VARIANT_KEYS:
                raise SimulationError(
                    f"unknown policy option {key!r} in {spec!r}; known: label, "
                    + ", ".join(sorted(_VARIANT_KEYS))
                )
            where, attr, kind = _VARIANT_KEYS[key]
            conv: object
            try:
                if kind == "xfer":
                    conv = parse_xfer(value)
                elif kind == "budget":
                    conv = parse_budget(value)
                elif kind == "bool":
                    conv = _parse_bool(value)
                elif kind == "optional_float":
                    conv = optional_float(value)
                else:
                    conv = kind(value)
            except ValueError:
                raise SimulationError(f"bad value {value!r} for {key} in {spec!r}") from None
            overrides.append((f"{where}.{attr}" if where else attr, conv))
        return cls(name, label, tuple(overrides))

    def apply(self, cfg: SimConfig) -> SimConfig:
        changes: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {"vlt": {}, "limits": {}}
        for key, value in self.overrides:
            where, _, attr = key.rpartition(".")
            (nested[where] if where else changes)[attr] = value
        try:
            for where, values in nested.items():
                if values:
                    changes[where] = dataclasses.replace(getattr(cfg, where), **values)
        except ValueError as e:
            raise SimulationError(f"{self.label}: {e}") from None
        return dataclasses.replace(cfg, **changes) if changes else cfg


# -- one run ------------------------------------------------------------------------------
@dataclass(slots=True)
class SimResult:
    policy: str
    label: str
    metrics: SLOMetrics
    stats: dict[str, float | int | None] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)
    # Per tenant, its share of the tokens and of the device block-seconds (several tenants).
    shares: dict[str, dict[str, float]] = field(default_factory=dict)


class Simulator:
    def __init__(
        self, hw: HardwareProfile, model: ModelProfile, policy: str, cfg: SimConfig,
        label: str | None = None,
    ) -> None:
        if policy not in POLICY_NAMES:
            raise SimulationError(f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        self.hw, self.model, self.policy_name, self.cfg = hw, model, policy, cfg
        self.label = label or policy
        self.scheduler: SchedulerInterface | None = None  # the last run's, for inspection
        self.block_bytes = model.block_bytes(cfg.block_size)
        budget = hw.device_kv_budget(model.weight_bytes)
        if cfg.device_blocks is not None:
            self.device_blocks = cfg.device_blocks
        else:
            self.device_blocks = int(budget // self.block_bytes)
        if self.device_blocks < 1:
            raise SimulationError(
                f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) leaves no room for "
                f"a KV block on {hw.name}"
            )
        self.host_blocks = (
            cfg.host_blocks if cfg.host_blocks is not None
            else int(hw.host_kv_bytes // self.block_bytes)
        )
        # The longest context a request may have (SchedulerConfig caps it by the pool too).
        self.context_len = min(cfg.max_model_len or model.max_model_len, model.max_model_len,
                               self.device_blocks * cfg.block_size)
        self.exec_model = ExecutionCostModel(hw, model)
        self.xfer_model = TransferCostModel(hw, model, cfg.block_size, cfg.layout, cfg.duplex)
        block_bw = hw.link.d2h(self.block_bytes)
        self.xfer_budget: int | None
        if cfg.xfer_budget_blocks is None:  # auto: the serve rule, from the link profile
            self.xfer_budget = xfer_budget(block_bw / self.block_bytes,
                                           floor=-(-self.context_len // cfg.block_size))
        elif cfg.xfer_budget_blocks == UNLIMITED:
            self.xfer_budget = None
        else:
            self.xfer_budget = cfg.xfer_budget_blocks
        if cfg.eager_budget_blocks == AUTO:
            # What D2H can copy during the shortest iteration (one decode token): in steady
            # state eager copies then never lengthen an iteration.
            shortest = self.exec_model.weight_bytes_read(1) / self.exec_model.bytes_per_s
            self.eager_budget = int(block_bw * shortest / self.block_bytes)
        else:
            self.eager_budget = cfg.eager_budget_blocks

    def scheduler_config(self) -> SchedulerConfig:
        c = self.cfg
        return SchedulerConfig(
            num_device_blocks=self.device_blocks,
            num_host_blocks=self.host_blocks,
            block_size=c.block_size,
            max_batched_tokens=c.max_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            max_model_len=min(c.max_model_len or self.model.max_model_len,
                              self.model.max_model_len),
            eager_budget_blocks=self.eager_budget,
            pipelined=c.pipeline,
            fairness=c.fairness,
        )

    def make_scheduler(self, clock: Callable[[], float]) -> SchedulerInterface:
        c = self.cfg
        policy = make_policy(
            self.policy_name,
            c.vlt,
            dataclasses.replace(c.limits, xfer_budget_blocks=self.xfer_budget),
        )
        cost: IterationCost | None = None
        if c.cost == "model":
            cost = ModelIterationCost(self.exec_model)
        elif c.cost == "online":
            cost = OnlineIterationCost()
        return Scheduler(self.scheduler_config(), policy, clock=clock, cost=cost)

    def run(self, trace: list[TraceRequest], duration_s: float | None = None) -> SimResult:
        """Serve `trace` on the simulated clock."""
        clock = VirtualClock()
        with asyncio.Runner(loop_factory=clock.new_loop) as runner:
            return runner.run(self._run(trace, duration_s, clock))

    async def _run(self, trace: list[TraceRequest], duration_s: float | None,
                   clock: VirtualClock) -> SimResult:
        wall0 = time.perf_counter()
        cfg = self.cfg
        sched = self.scheduler = self.make_scheduler(clock)
        slo = SLO(cfg.ttft_slo, cfg.tbt_slo)
        link = _SimLink(self.xfer_model)
        worker = _SimWorker(self.exec_model)
        core = EngineCore(sched, worker, link, timer=clock, pipeline=cfg.pipeline)
        # Clip to the model's context only: a prompt larger than the device pool (the
        # scheduler's own cap) is refused by add_request and counted as a miss below.
        max_len = min(cfg.max_model_len or self.model.max_model_len, self.model.max_model_len)
        pending = sorted(trace, key=lambda r: (r.arrival_s, r.index))
        last_arrival = pending[-1].arrival_s if pending else 0.0
        max_sim_s = cfg.max_sim_s if cfg.max_sim_s is not None else 10 * last_arrival + 600.0

        records: list[RequestRecord] = []
        classes: dict[str, str] = {}  # request id -> SLO class name
        clipped = rejected = 0
        max_running = 0
        batch_tokens = 0
        idle_iterations = 0
        i = 0
        while True:
            while i < len(pending) and pending[i].arrival_s <= clock.t:
                tr = pending[i]
                i += 1
                plen = min(tr.prompt_len, max_len - 1)
                olen = max(1, min(tr.output_len, max_len - plen))
                clipped += plen != tr.prompt_len or olen != tr.output_len
                own = slo if tr.slo is None else SLO(tr.slo.ttft_s, tr.slo.tbt_s)
                # Known: ignore_eos, max_tokens = its length. Unknown: bounded by the
                # context, its EOS comes at the trace's length.
                known = cfg.lengths == "known"
                bound = max_len - plen  # unknown: the context, or the client's max_tokens
                if not known and cfg.max_tokens is not None:
                    bound = min(bound, cfg.max_tokens)
                    olen = min(olen, bound)
                req = Request(
                    f"r{tr.index}", [0] * plen,
                    SamplingParams(max_tokens=olen if known else bound,
                                   temperature=0.0, ignore_eos=known),
                    arrival_time=tr.arrival_s, slo=own,
                    eos_token_ids=() if known else (EOS_TOKEN,),
                    tenant=tr.tenant, weight=tr.weight,
                )
                if not known:
                    worker.ends[req.request_id] = olen
                if tr.slo is not None:
                    classes[req.request_id] = tr.slo.name
                try:
                    sched.add_request(req)
                except ValueError:
                    rejected += 1  # bigger than the whole device pool: a miss, never served
                    records.append(RequestRecord.from_request(
                        req, tr.slo.name if tr.slo is not None else None))
            if not sched.has_unfinished():
                if i >= len(pending):
                    break
                clock.advance_to(pending[i].arrival_s)
                continue
            if clock.t > max_sim_s:
                break

            step = await core.step()
            if not step.busy:
                # Nothing runnable and nothing moving: only an arrival can change that.
                idle_iterations += 1
                if i < len(pending):
                    clock.advance_to(pending[i].arrival_s)
                    continue
                raise SimulationError(
                    f"{self.label}: the scheduler made no progress at t={clock.t:.3f}s with "
                    f"{len(sched.waiting)} waiting, {len(sched.running)} running, "
                    f"{len(sched.rotary)} rotary requests and no arrival left"
                )
            batch_tokens += step.out.num_tokens
            max_running = max(max_running, step.out.num_running)
            if sched.finished_log:
                records.extend(RequestRecord.from_request(r, classes.get(r.request_id))
                               for r in sched.collect_finished())

        unfinished = list(sched.requests.values())
        records.extend(RequestRecord.from_request(r, classes.get(r.request_id), clock.t)
                       for r in unfinished)
        for tr in pending[i:]:  # the clock stopped (max_sim_s) before they arrived
            own = slo if tr.slo is None else SLO(tr.slo.ttft_s, tr.slo.tbt_s)
            records.append(RequestRecord(f"r{tr.index}", tr.arrival_s, [], own.ttft_s,
                                         own.tbt_s, tr.prompt_len, finished=False,
                                         slo_class=tr.slo.name if tr.slo is not None else None))
        records.sort(key=lambda r: r.arrival_s)
        metrics = compute_metrics(records, duration_s)
        s = sched.stats
        stats: dict[str, float | int | None] = {
            "requests": len(trace),
            "unfinished": len(unfinished) + len(pending) - i,
            "rejected": rejected,
            "clipped": clipped,
            "device_blocks": self.device_blocks,
            "host_blocks": self.host_blocks,
            "block_bytes": self.block_bytes,
            "xfer_budget_blocks": self.xfer_budget,
            "eager_budget_blocks": self.eager_budget,
            "iterations": s.iterations,
            "idle_iterations": idle_iterations,
            "executes": core.stats.executes,  # iterations that ran a batch (others only moved blocks)
            "sim_time_s": clock.t,
            "execute_s": core.stats.execute_s,
            "transfer_s": link.busy_s,  # the link's busy time
            "transfer_wait_s": core.stats.transfer_wait_s,  # ... of which the step waited
            "pipeline": cfg.pipeline,
            "mean_iteration_s": clock.t / max(1, s.iterations),
            "mean_batch_tokens": batch_tokens / max(1, s.iterations),
            "max_running": max_running,
            "rotations": s.rotations,
            "swap_in_blocks": s.swap_in_blocks,
            "swap_out_blocks": s.swap_out_blocks,
            "eager_blocks": s.eager_blocks,
            "freed_without_copy": s.freed_without_copy,
            "recomputes": s.recomputes,
            "preemptions": s.preemptions,
            # ... of which a running request needed blocks (the rest: for a candidate)
            "growth_preemptions": s.growth_preemptions,
            "parked_preemptions": s.parked_preemptions,  # ... and to seat a parked request
            "decision_s_total": s.decision_s_total,
            "decision_s_max": s.decision_s_max,
            "wall_s": time.perf_counter() - wall0,
        }
        return SimResult(self.policy_name, self.label, metrics, stats, records,
                         sched.shares.shares() if sched.shares.accounting else {})


class _SimWorker:
    """The execution cost model as the core's Executor: one batch at a time, each taking
    its modelled time; every sampled request gets token 0, or EOS_TOKEN as its output
    reaches `ends[request id]` (the requests that run until EOS)."""

    def __init__(self, model: ExecutionCostModel) -> None:
        self.model = model
        self._busy: asyncio.Lock | None = None
        self.ends: dict[str, int] = {}

    async def execute(
        self, iteration: int, chunks: list[ScheduledChunk], after: int = 0,
        released: Sequence[str] = (),
    ) -> ExecuteResult:
        ex = self.model.iteration_s(chunks)
        if self._busy is None:
            self._busy = asyncio.Lock()
        async with self._busy:  # FIFO: batches run in the order they were sent
            await asyncio.sleep(ex)
        ends = self.ends
        return ExecuteResult(sampled={c.request_id: EOS_TOKEN if ends.get(c.request_id)
                                      == c.output_index + 1 else 0
                                      for c in chunks if c.sample},
                             execute_s=ex)


class _SimLink:
    """The transfer cost model as the core's TransferEngine: a plan's copies — swaps and
    eager copies alike, each direction on its own stream when duplex — take the time the
    model gives them on the link, one plan after another."""

    def __init__(self, model: TransferCostModel) -> None:
        self.model = model
        self.busy_s = 0.0
        self._busy: asyncio.Lock | None = None

    async def transfer(self, plan: TransferPlan) -> TransferResult:
        moves = TransferPlan(plan.fence, swap_out=plan.swap_out + plan.eager,
                             swap_in=plan.swap_in + plan.late_swap_in)
        xt = self.model.plan_time(moves)
        if self._busy is None:
            self._busy = asyncio.Lock()
        async with self._busy:
            await asyncio.sleep(xt.critical_s)
        self.busy_s += xt.critical_s
        return TransferResult(xt.d2h_s, xt.h2d_s, xt.critical_s, int(xt.d2h_bytes),
                              int(xt.h2d_bytes))


def simulate(
    hw: HardwareProfile,
    model: ModelProfile,
    variant: PolicyVariant,
    cfg: SimConfig,
    trace: list[TraceRequest],
    duration_s: float | None = None,
) -> SimResult:
    sim = Simulator(hw, model, variant.policy, variant.apply(cfg), label=variant.label)
    return sim.run(trace, duration_s)

