"""Building the scheduler core from the engine's configuration.

The one place that maps `EngineConfig` (the flags, common/config.py) onto the core's own
objects: `SchedulerConfig`, the policy with its VLT parameters and rotation limits, and the
default SLO. The service, the in-process engine and the benchmarks all build through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.config import EngineConfig
from scheduler_svc.policy import Policy, RotationLimits, VLTParams, make_policy
from scheduler_svc.policy.iteration_cost import OnlineIterationCost
from scheduler_svc.request import SLO
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def rotation_limits(cfg: EngineConfig) -> RotationLimits:
    """The policy's rules at their values, B_xfer from the setting (auto, None: unlimited
    until the engine core has measured the link; `EngineCore(auto_xfer_budget=True)`)."""
    return RotationLimits(xfer_budget_blocks=cfg.xfer_budget_blocks)


def default_slo(cfg: EngineConfig) -> SLO:
    return SLO(cfg.ttft_slo, cfg.tbt_slo)


def policy_from(cfg: EngineConfig) -> Policy:
    return make_policy(cfg.policy, VLTParams(), rotation_limits(cfg))


def model_identity(source_path: str, dtype: str) -> str:
    """What roots the prefix cache's block names: KV of another model file or dtype never
    matches (scheduler_svc/prefix_cache.py)."""
    return f"{source_path}|{dtype}"


def scheduler_config(
    cfg: EngineConfig, num_device_blocks: int, num_host_blocks: int, model_max_len: int,
    model_id: str = "",
) -> SchedulerConfig:
    """The core's settings once the pools and the model's context are known."""
    return SchedulerConfig(
        num_device_blocks=num_device_blocks,
        num_host_blocks=num_host_blocks,
        block_size=cfg.block_size,
        max_batched_tokens=cfg.max_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=min(cfg.max_model_len or model_max_len, model_max_len),
        pipelined=cfg.pipeline,
        enable_prefix_caching=cfg.enable_prefix_caching,
        model_id=model_id,
        speculative=cfg.speculative_config,
    )


def build_scheduler(
    cfg: EngineConfig, num_device_blocks: int, num_host_blocks: int, model_max_len: int,
    clock: Callable[[], float] = time.monotonic, model_id: str = "",
) -> Scheduler:
    policy = policy_from(cfg)
    # The executor's measured batch times, for a policy that keeps iterations under a target.
    cost = OnlineIterationCost() if policy.iteration_target_s(cfg.tbt_slo) is not None else None
    return Scheduler(scheduler_config(cfg, num_device_blocks, num_host_blocks, model_max_len,
                                      model_id),
                     policy, clock=clock, cost=cost)
