"""Scheduling policies: `make_policy(name, …)` is what `--policy` selects."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from common.config import POLICY_NAMES
from scheduler_svc.policy.base import Policy, RotationLimits, Unservable
from scheduler_svc.policy.baselines import FCFSPolicy, SwappedFirstPolicy, WaitingFirstPolicy
from scheduler_svc.policy.lvf import LVFPolicy
from scheduler_svc.policy.vlt import VLTParams, vlt

_Params = TypeVar("_Params", VLTParams, RotationLimits)


def params_from(cls: type[_Params], config: object, **overrides: Any) -> _Params:
    """`cls` (VLTParams, RotationLimits) with every field taken from `config`'s attribute
    of the same name (an engine or simulator config), `overrides` first. A field that
    `config` lacks and `overrides` does not give is an error, so a new parameter cannot
    silently keep its default in one config while another sets it."""
    values = dict(overrides)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            if not hasattr(config, f.name):
                raise TypeError(f"{type(config).__name__} has no {f.name!r} for {cls.__name__}")
            values[f.name] = getattr(config, f.name)
    return cls(**values)


def make_policy(
    name: str, params: VLTParams | None = None, limits: RotationLimits | None = None
) -> Policy:
    params = params or VLTParams()
    limits = limits or RotationLimits()
    if name == "lvf":
        return LVFPolicy(params, limits)
    # vLLM's baselines know no rotation limits; only a time target may be given to them
    # (a what-if: none of them has one).
    timed = RotationLimits(iteration_budget=limits.iteration_budget,
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
    "params_from",
    "vlt",
]
