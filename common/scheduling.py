"""What a user sets about scheduling: eight settings, declared once.

`SchedulingSettings` is the one home of these settings and their defaults. `EngineConfig`
(the server's configuration) and `SimConfig` (the simulator's) inherit it, and
`add_setting_flags` writes their command-line flags from the fields, so `superinfer serve
--help`, `superinfer sim --help` and docs/cli.md (generated from the parser) say the same
thing. Names follow vLLM where the meaning is the same.

Everything else the scheduler does is a rule or a number computed from these settings and
what the engine measures (docs/rotasched.md lists each with the measurement behind it).
The policy's own constants live in `scheduler_svc/policy/` (`VLTParams`,
`RotationLimits`) and have no command-line flag: the experiments folder varies them, through
the simulator's policy specs and `experiments/rules_scheduler.py`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

# The values of --policy (scheduler_svc/policy/__init__.py builds one policy per name).
POLICY_NAMES = ("lvf", "fcfs", "swapped-first", "waiting-first")


def block_budget(text: str) -> int | None:
    """`--xfer-budget-blocks`: 'auto' (None) or a block count >= 0."""
    t = text.strip().lower()
    if t == "auto":
        return None
    try:
        v = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a block count, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"a block budget must be >= 0, got {v}")
    return v


def _setting(default: Any, *flags: str, help: str, type: Any = None,  # noqa: A002
             choices: tuple[str, ...] | None = None, switch: bool = False,
             metavar: str | None = None) -> Any:
    meta = {"flags": flags, "help": help, "type": type, "choices": choices, "switch": switch,
            "metavar": metavar}
    return field(default=default, metadata=meta)


@dataclass(slots=True)
class SchedulingSettings:
    policy: str = _setting(
        "lvf", "--policy", "--scheduling-policy", choices=POLICY_NAMES,
        help="who holds the device each iteration: lvf (RotaSched's Largest-VLT-First), or "
             "vLLM's fcfs, swapped-first, waiting-first")
    ttft_slo: float = _setting(
        5.0, "--ttft-slo", type=float,
        help="default TTFT SLO in seconds (a request may send its own)")
    tbt_slo: float = _setting(
        0.1, "--tbt-slo", type=float,
        help="default TBT SLO in seconds, the time between tokens (a request may send its own)")
    max_num_seqs: int = _setting(
        256, "--max-num-seqs", type=int, help="requests in one batch at most")
    max_batched_tokens: int = _setting(
        512, "--max-num-batched-tokens", "--max-batched-tokens", type=int,
        help="tokens in one batch at most (prefill chunks and decodes together)")
    xfer_budget_blocks: int | None = _setting(  # None: auto
        None, "--xfer-budget-blocks", type=block_budget, metavar="N|auto",
        help="B_xfer, KV blocks rotated between device and host per iteration: a count, or "
             "auto (what the link moves one way in 50 ms, from the transfer engine's "
             "measured rate, and at least one request at the longest context)")
    enable_prefix_caching: bool = _setting(
        True, "--enable-prefix-caching", switch=True,
        help="reuse the KV of cached prompt prefixes, from device memory or (eager host "
             "copies) host memory")
    pipeline: bool = _setting(
        True, "--pipeline", switch=True,
        help="plan and copy the next iteration while this one executes (--no-pipeline: the "
             "serial step, the baseline)")

    def check(self) -> None:
        """Raise ValueError naming the flag of the first setting out of range."""
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICY_NAMES)}")
        for flag, v in (("--ttft-slo", self.ttft_slo), ("--tbt-slo", self.tbt_slo)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be a positive number of seconds, got {v}")
        if self.max_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be at least 1, got {self.max_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.xfer_budget_blocks is not None and self.xfer_budget_blocks < 0:
            raise ValueError(f"--xfer-budget-blocks must be >= 0 (auto: from the link), got "
                             f"{self.xfer_budget_blocks}")


def add_setting_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                      skip: tuple[str, ...] = ()) -> None:
    """One flag per field (but those in `skip`), its default the declared one."""
    for f in fields(SchedulingSettings):
        if f.name in skip:
            continue
        meta = f.metadata
        default = f.default
        assert default is not MISSING
        shown = "auto" if default is None else "%(default)s"
        kw: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": f"{meta['help']} (default: {shown})"}
        if meta["switch"]:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if meta["type"] is not None:
                kw["type"] = meta["type"]
            if meta["choices"] is not None:
                kw["choices"] = list(meta["choices"])
            if meta["metavar"] is not None:
                kw["metavar"] = meta["metavar"]
        p.add_argument(*meta["flags"], **kw)


SETTING_NAMES = tuple(f.name for f in fields(SchedulingSettings))
