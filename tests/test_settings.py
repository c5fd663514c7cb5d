"""The scheduling settings a user has: at most eight, declared once, and nothing else.

common/scheduling.py declares them; the server's parser, its config, the simulator's
config and parser, and the policy must agree on every default, and LVF's rules (the
policy's own constants) must have no route in: no flag, hidden or not, no environment
variable, no config field.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from common.config import EngineConfig
from common.scheduling import SETTING_NAMES, SchedulingSettings
from scheduler_svc.policy import RotationLimits, VLTParams, make_policy
from scheduler_svc.setup import policy_from, scheduler_config
from superinfer.cli import build_parser
from superinfer.cli_doc import COMMANDS
from superinfer.sim.engine import SimConfig

ROOT = Path(__file__).resolve().parent.parent
# What the scheduling group of `serve --help` had before (22 flags), but the eight kept.
REMOVED = ("alpha", "beta_b", "beta_f", "max_stall", "min_residency", "vlt_margin", "hold_vlt",
           "iteration_budget", "prefill_within", "lazy_rotation", "lazy_margin",
           "parked_first", "park_cover", "growth_room", "memory_margin",
           "eager_budget_blocks")
POLICY_RULES = {f.name for cls in (VLTParams, RotationLimits) for f in dataclasses.fields(cls)}


def _subparser(words: list[str]) -> argparse.ArgumentParser:
    node: argparse.ArgumentParser = build_parser(words)
    for w in words:
        sub = next(a for a in node._actions if isinstance(a, argparse._SubParsersAction))
        node = sub.choices[w]
    return node


def _group(parser: argparse.ArgumentParser, title_start: str) -> list[argparse.Action]:
    groups = [g for g in parser._action_groups if (g.title or "").startswith(title_start)]
    assert len(groups) == 1, [g.title for g in parser._action_groups]
    return groups[0]._group_actions


def test_serve_help_lists_eight_scheduling_settings_with_vllm_names() -> None:
    serve = _subparser(["serve"])
    actions = _group(serve, "scheduling")
    assert len(actions) <= 8
    assert {a.dest for a in actions} == set(SETTING_NAMES)
    flags = {s for a in actions for s in a.option_strings}
    # vLLM's names where the meaning is the same (the old ones stay as aliases).
    assert {"--max-num-seqs", "--max-num-batched-tokens", "--scheduling-policy",
            "--enable-prefix-caching"} <= flags
    args = serve.parse_args(["--scheduling-policy", "fcfs", "--max-num-batched-tokens", "64"])
    cfg = EngineConfig.from_args(args)
    assert (cfg.policy, cfg.max_batched_tokens) == ("fcfs", 64)
    text = serve.format_help()
    assert "(default: auto)" in text and "(default: 0.1)" in text


def test_every_parser_config_and_the_policy_agree_on_each_default() -> None:
    """One home: SchedulingSettings' declared defaults are what each parser fills in, what
    each config holds, and what the policy is built with; a default written anywhere else
    fails here."""
    declared = SchedulingSettings()
    engine, sim = EngineConfig(), SimConfig()
    for words in (["serve"], ["scheduler"], ["generate"], ["sim"]):
        parsed = vars(_subparser(words).parse_args([]))
        for name in SETTING_NAMES:
            if name in parsed:
                assert parsed[name] == getattr(declared, name), (words, name)
    for name in SETTING_NAMES:
        assert getattr(engine, name) == getattr(sim, name) == getattr(declared, name), name
    # The policy as serve builds it: its rules at their declared values, B_xfer auto.
    lvf = policy_from(engine)
    assert lvf.limits == RotationLimits() and lvf.params == VLTParams()  # type: ignore[attr-defined]
    assert sim.limits == RotationLimits() and sim.vlt == VLTParams()
    sc = scheduler_config(engine, 100, 100, 4096)
    assert (sc.max_num_seqs, sc.max_batched_tokens, sc.pipelined, sc.enable_prefix_caching) == (
        engine.max_num_seqs, engine.max_batched_tokens, engine.pipeline,
        engine.enable_prefix_caching)


@pytest.mark.parametrize("name", REMOVED)
def test_a_removed_setting_has_no_route_into_the_server(name: str) -> None:
    """No flag (shown or hidden) of any command but the simulator's (which keeps the eager
    budget as a what-if of the transfer engine), no config field."""
    flag = "--" + name.replace("_", "-")
    for words, _ in COMMANDS:
        if words[0] == "sim" and name not in POLICY_RULES:
            continue
        parser = _subparser(words)
        dests = {a.dest for a in parser._actions}
        options = {s for a in parser._actions for s in a.option_strings}
        assert name not in dests and flag not in options, (words, flag)
    with pytest.raises(SystemExit):
        _subparser(["serve"]).parse_args([flag, "1"])
    with pytest.raises(TypeError):
        EngineConfig(**{name: 1})
    if name in POLICY_RULES:
        assert name not in {f.name for f in dataclasses.fields(SimConfig)}


def test_no_environment_variable_reaches_a_policy_rule() -> None:
    """Every environment variable the shipped code reads, by name: none is about scheduling."""
    read = set()
    for d in ("common", "scheduler_svc", "worker", "kvmem_svc", "gateway", "superinfer"):
        for path in (ROOT / d).rglob("*.py"):
            text = path.read_text()
            read |= set(re.findall(r"environ(?:\.get)?[\[(]\s*\"([A-Z0-9_]+)\"", text))
            read |= set(re.findall(r"getenv\(\s*\"([A-Z0-9_]+)\"", text))
    assert read, "the scan found no environment variable at all: it is broken"
    for var in read:
        words = var.lower().removeprefix("superinfer_")
        assert words not in POLICY_RULES | set(REMOVED) | set(SETTING_NAMES), var


def test_the_baselines_keep_vllms_behaviour_and_no_rule_of_lvf() -> None:
    for name in ("fcfs", "swapped-first"):
        p = make_policy(name, VLTParams(), RotationLimits())
        assert p.limits == RotationLimits.bare()
        assert not p.bounded_transfers
    assert make_policy("waiting-first", VLTParams(), RotationLimits()).limits == RotationLimits()


def test_xfer_budget_auto_is_what_the_measured_link_moves_in_50_ms() -> None:
    """`--xfer-budget-blocks auto`: unlimited until a copy is measured, then the blocks the
    slower direction moves in 50 ms, from the transfer engine's own busy times; copies too
    short to tell the link from the call overhead do not count; fcfs has no B_xfer."""
    import asyncio

    from common.contracts import TransferPlan, TransferResult
    from scheduler_svc.engine_core import EngineCore
    from scheduler_svc.policy.xfer_budget import LinkRate
    from scheduler_svc.scheduler import Scheduler
    from scheduler_svc.scheduler_config import SchedulerConfig

    class Link:
        def __init__(self) -> None:
            self.result = TransferResult()

        async def transfer(self, plan: TransferPlan) -> TransferResult:
            return self.result

    def core(policy: str, auto: bool) -> tuple[EngineCore, Scheduler, Link]:
        sched = Scheduler(SchedulerConfig(num_device_blocks=64, num_host_blocks=64),
                          policy_from(EngineConfig(policy=policy)))
        link = Link()
        return EngineCore(sched, None, link, auto_xfer_budget=auto), sched, link  # type: ignore[arg-type]

    out200 = TransferPlan(fence=1, swap_out=[(i, i) for i in range(200)])
    in50 = TransferPlan(fence=2, swap_in=[(i, i) for i in range(50)])
    c, sched, link = core("lvf", auto=True)
    assert sched.policy.limits.xfer_budget_blocks is None
    link.result = TransferResult(d2h_s=0.001)  # 1 ms: overhead, not the link
    asyncio.run(c._copy(out200))
    assert sched.policy.limits.xfer_budget_blocks is None
    link.result = TransferResult(d2h_s=0.01)  # 20,000 blocks/s D2H: 1,000 in 50 ms
    asyncio.run(c._copy(out200))
    assert sched.policy.limits.xfer_budget_blocks == 1000
    link.result = TransferResult(h2d_s=0.01)  # 5,000 blocks/s H2D: the slower one rules
    asyncio.run(c._copy(in50))
    assert sched.policy.limits.xfer_budget_blocks == 250
    for policy, auto in (("fcfs", True), ("lvf", False)):
        c, sched, link = core(policy, auto)
        link.result = TransferResult(d2h_s=0.01)
        asyncio.run(c._copy(out200))
        assert sched.policy.limits.xfer_budget_blocks is None, policy
    # Never under one request at the longest context: 64 blocks here (1,024 tokens).
    c, sched, link = core("lvf", auto=True)
    link.result = TransferResult(d2h_s=0.5)  # 400 blocks/s: 20 in 50 ms
    asyncio.run(c._copy(out200))
    assert sched.config.max_model_len == 1024 and sched.policy.limits.xfer_budget_blocks == 64
    rate = LinkRate(smoothing=0.5)
    rate.observe(out200, TransferResult(d2h_s=0.01))
    rate.observe(out200, TransferResult(d2h_s=0.02))  # 10,000/s: the mean moves halfway
    assert rate.budget() == 750


def test_lvf_residency_falls_as_waiting_requests_turn_late_and_returns_when_they_are_served() -> None:
    """The adaptive residency (off by default: it did not pay): the full 32 iterations
    while at most 2 % of the running batch waits late, none from 10 %, linear between; it
    counts a queue's late ones from its head only, and stays fixed where it is off."""
    from scheduler_svc.policy.lvf import LVFPolicy
    from scheduler_svc.queue import RequestQueue
    from scheduler_svc.request import SLO, Request, SamplingParams

    assert make_policy("lvf", VLTParams(), RotationLimits()).residency is None  # type: ignore[attr-defined]
    lvf = make_policy("lvf", VLTParams(), RotationLimits(adapt_residency=True))
    assert isinstance(lvf, LVFPolicy)
    waiting = RequestQueue(lambda r: lvf.order_key(r, False))
    now = 100.0

    def wait(n: int, arrival: float) -> None:
        for _ in range(n):
            waiting.append(Request(f"r{len(waiting)}", [1, 2], SamplingParams(max_tokens=4),
                                   arrival_time=arrival, slo=SLO(2.0, 0.1)))

    assert lvf.min_residency(waiting, 100, now) == 32  # nobody waits
    wait(2, 90.0)  # 10 s for a 2 s TTFT SLO: late
    wait(50, 99.9)  # on time
    assert lvf.min_residency(waiting, 100, now) == 32  # 2 % of 100 running
    wait(4, 91.0)
    assert lvf.min_residency(waiting, 100, now) == 16  # 6 %: half way
    wait(5, 92.0)
    assert lvf.min_residency(waiting, 100, now) == 0  # 11 %
    assert lvf.min_residency(waiting, 1000, now) == 32  # the same 11 late in a larger batch
    for r in list(waiting):
        if r.arrival_time < 99.0:
            waiting.remove(r)  # served
    assert lvf.min_residency(waiting, 100, now) == 32
    fixed = make_policy("lvf", VLTParams(), RotationLimits(adapt_residency=False, min_residency=7))
    wait(20, 50.0)
    assert fixed.min_residency(waiting, 100, now) == 7
