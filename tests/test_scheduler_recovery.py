"""Scheduler recovery (DESIGN §6) with the KV-checking executor: a peer loses memory
mid-run and every request still produces exactly the tokens of an undisturbed run.

A lost pool is simulated by overwriting the checker's blocks with garbage, so a request
that resumed from memory it no longer has reads a wrong context and fails the check.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from common.contracts import TransferPlan
from scheduler_svc.policy import POLICY_NAMES, RotationLimits, make_policy
from scheduler_svc.request import SLO, Request, RequestState, SamplingParams
from scheduler_svc.scheduler import Recovery, Scheduler, SchedulerConfig
from tests.kvcheck import CheckingExecutor, KVStore
from tests.test_scheduler import FakeClock, expected, workload

GARBAGE = -7


def wipe(blocks: list[list[int]], which: set[int] | None = None) -> None:
    for i, block in enumerate(blocks):
        if which is None or i in which:
            block[:] = [GARBAGE] * len(block)


# A fault: (scheduler, store, the iteration's transfer plan or None) -> the plan to treat
# as failed, after simulating what the peer lost. Called at one chosen iteration.
Fault = Callable[[Scheduler, KVStore, TransferPlan | None], Recovery]


def run_with_fault(
    fault: Fault,
    at: str,
    fault_iteration: int,
    policy: str = "lvf",
    n: int = 24,
    device_blocks: int = 24,
    host_blocks: int = 200,
    seed: int = 1,
    repeat: int = 1,
    caching: bool = False,
) -> tuple[dict[str, list[int]], Scheduler, list[Recovery]]:
    """Run a workload; at `fault_iteration` (and every `repeat`-th one after, `repeat`
    times) the iteration fails at `at` ("transfer" or "execute") and `fault` recovers.
    `caching`: prefix caching on, and prompts that share prefixes."""
    prompts, lens = workload(n, seed=seed, shared=caching)
    clock = FakeClock()
    sched = Scheduler(
        SchedulerConfig(num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                        block_size=4, max_batched_tokens=32, eager_budget_blocks=8,
                        enable_prefix_caching=caching),
        make_policy(policy, limits=RotationLimits.bare()), clock=clock,
    )
    store = KVStore(device_blocks, host_blocks, 4)
    truth: dict[str, list[int]] = {}  # request id -> prompt
    got: dict[str, list[int]] = {}  # request id -> tokens that landed
    execu = CheckingExecutor(store, truth)
    arrivals = [i * 0.02 for i in range(n)]
    pending = list(range(n))
    outputs: dict[str, list[int]] = {}
    recoveries: list[Recovery] = []
    faults_left, next_fault = repeat, fault_iteration
    for it in range(100_000):
        while pending and arrivals[pending[0]] <= clock.t:
            i = pending.pop(0)
            truth[f"r{i}"] = list(prompts[i])
            sched.add_request(Request(
                f"r{i}", list(prompts[i]), SamplingParams(max_tokens=lens[i], ignore_eos=True),
                arrival_time=clock.t, slo=SLO(1.0, 0.2)))
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        clock.t += 0.05
        plan = out.transfers
        failing = faults_left > 0 and it >= next_fault and (
            plan is not None if at == "transfer" else bool(out.chunks))
        if failing:
            faults_left, next_fault = faults_left - 1, it + 7
        if failing and at == "transfer" and plan is not None:
            # Half the copies happened before the peer went away; the fence is released.
            half = TransferPlan(plan.fence, plan.swap_out[::2], plan.swap_in[::2], plan.eager[::2])
            store.transfer(half)
            sched.complete_transfer(plan.fence)
            recoveries.append(fault(sched, store, plan))
            sched.check_integrity()
            continue
        if plan is not None:
            store.transfer(plan)
            sched.complete_transfer(plan.fence)
        if failing and at == "execute" and out.chunks:
            execu.execute(out.chunks[::2])  # some of the batch ran, its results are lost
            recoveries.append(fault(sched, store, None))
            sched.check_integrity()
            continue
        for ev in sched.update_from_output(out, execu.execute(out.chunks)):
            got.setdefault(ev.request_id, []).extend(ev.new_token_ids)
            if ev.finish_reason is not None:
                outputs[ev.request_id] = got[ev.request_id]
        sched.check_integrity()
    assert not sched.has_unfinished()
    assert faults_left == 0, "the fault never fired: pick an earlier iteration"
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == expected(p, lens[i]), f"r{i} changed by the recovery"
    assert sched.bm.num_free_device == device_blocks and sched.bm.num_free_host == host_blocks
    assert sched.bm.pending_fences == []
    return outputs, sched, recoveries


def worker_restart(sched: Scheduler, store: KVStore, plan: TransferPlan | None) -> Recovery:
    wipe(store.device)
    return sched.device_lost(failed=plan)


def kvmem_restart(sched: Scheduler, store: KVStore, plan: TransferPlan | None) -> Recovery:
    wipe(store.host)
    if plan is not None:  # swap-ins of the failed batch may not have happened
        wipe(store.device, {d for _, d in plan.swap_in})
    return sched.host_lost(failed=plan)


def transfer_lost(sched: Scheduler, store: KVStore, plan: TransferPlan | None) -> Recovery:
    """A batch failed (say, a deadline), both pools survive: only its own writes are bad."""
    assert plan is not None
    wipe(store.host, {h for _, h in plan.swap_out + plan.eager})
    wipe(store.device, {d for _, d in plan.swap_in})
    return sched.kv_lost(failed=plan)


def both_restart(sched: Scheduler, store: KVStore, plan: TransferPlan | None) -> Recovery:
    wipe(store.device)
    wipe(store.host)
    return sched.kv_lost(device=True, host=True, failed=plan)


@pytest.mark.parametrize(("policy", "at"), [
    (p, at) for p in POLICY_NAMES for at in ("execute", "transfer")
    if not (p == "fcfs" and at == "transfer")  # fcfs never transfers
])
def test_worker_restart_resumes_every_request_unchanged(policy: str, at: str) -> None:
    _, sched, recs = run_with_fault(worker_restart, at, 12, policy=policy, repeat=3)
    assert sum(len(r.kept) for r in recs) == 0  # nothing survives on the device
    if policy != "fcfs":  # fcfs never copies to the host
        # Eager host copies let running requests resume by swap-in rather than recompute.
        assert sum(len(r.swap_in) for r in recs) > 0


@pytest.mark.parametrize("policy", ["lvf", "swapped-first"])
@pytest.mark.parametrize("at", ["execute", "transfer"])
def test_kvmem_restart_rotary_requests_recompute(policy: str, at: str) -> None:
    _, sched, recs = run_with_fault(kvmem_restart, at, 12, policy=policy, repeat=3)
    assert all(not r.swap_in for r in recs)  # no host copy survives
    assert sum(len(r.kept) for r in recs) > 0  # the device pool did
    assert sum(len(r.recompute) for r in recs) > 0


@pytest.mark.parametrize("fault", [transfer_lost, both_restart])
def test_failed_batch_and_double_restart_are_lossless(fault: Fault) -> None:
    run_with_fault(fault, "transfer", 10, repeat=4, seed=3)


def test_device_lost_keeps_host_prefix_and_recomputes_tail() -> None:
    clock = FakeClock()
    sched = Scheduler(SchedulerConfig(num_device_blocks=16, num_host_blocks=16, block_size=4,
                                      eager_budget_blocks=8),
                      make_policy("lvf"), clock=clock)
    sched.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=8), 0.0))
    sched.add_request(Request("b", [1], SamplingParams(max_tokens=8), 0.0))
    out = sched.schedule()  # both prefill; no host copies yet
    for p in filter(None, [out.transfers]):
        sched.complete_transfer(p.fence)
    sched.update_from_output(out, CheckingExecutor(KVStore(16, 16, 4), {
        "a": list(range(10)), "b": [1]}).execute(out.chunks))
    out = sched.schedule()  # a: 2 synced blocks get eager copies
    assert out.transfers is not None and len(out.transfers.eager) == 2
    sched.complete_transfer(out.transfers.fence)
    rec = sched.device_lost()
    a, b = sched.requests["a"], sched.requests["b"]
    assert rec.swap_in == ["a"] and rec.recompute == ["b"] and rec.kept == []
    assert a.state is RequestState.ROTARY and a.num_computed_tokens == 8  # 2 blocks kept
    assert b.state is RequestState.WAITING and b.num_computed_tokens == 0
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1  # tokens kept
    assert sched.bm.num_free_device == 16 and sched.bm.num_free_host == 14
    sched.check_integrity()
    rec = sched.host_lost()
    assert rec.recompute == ["a"] and a.state is RequestState.WAITING
    assert sched.bm.num_free_host == 16
    sched.check_integrity()


def test_kv_lost_refuses_mid_iteration() -> None:
    sched = Scheduler(SchedulerConfig(num_device_blocks=8), make_policy("lvf"))
    sched.bm.begin_iteration()
    with pytest.raises(RuntimeError, match="between iterations"):
        sched.device_lost()
