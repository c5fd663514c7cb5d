"""Scheduling policies: `make_policy(name, …)` is what `--policy` selects."""

from __future__ import annotations

import dataclasses

from common.scheduling import POLICY_NAMES
from scheduler_svc.policy.base import BARE_LIMITS, Policy, RotationLimits, Unservable
from scheduler_svc.policy.baselines import FCFSPolicy, SwappedFirstPolicy, WaitingFirstPolicy
from scheduler_svc.policy.lvf import LVFPolicy
from scheduler_svc.policy.vlt import VLTParams, vlt


def make_policy(
    name: str, params: VLTParams | None = None, limits: RotationLimits | None = None
) -> Policy:
    params = params or VLTParams()
    limits = limits or RotationLimits()
    if name == "lvf":
        return LVFPolicy(params, limits)
    # vLLM's baselines know no rotation limits; only a time target may be given to them
    # (a what-if: none of them has one).
    timed = dataclasses.replace(BARE_LIMITS, iteration_budget=limits.iteration_budget,
                                prefill_within=limits.prefill_within)
    if name == "fcfs":
        return FCFSPolicy(timed)
    if name == "swapped-first":
        return SwappedFirstPolicy(timed)
    if name == "waiting-first":
        return WaitingFirstPolicy(limits)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = [
    "POLICY_NAMES",
    "Policy",
    "RotationLimits",
    "Unservable",
    "VLTParams",
    "make_policy",
    "vlt",
]
