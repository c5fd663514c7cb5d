"""Property test: random admit/grow/rotate/finish/abort sequences keep the two-tier block
manager consistent, and every block comes back to its pool."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import Request, RequestState, SamplingParams

OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "rotate_out", "rotate_in", "finish", "eager", "fence"]),
        st.integers(0, 7),  # which request
        st.integers(1, 40),  # tokens
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, device=st.integers(1, 24), host=st.integers(0, 24), bs=st.sampled_from([1, 4, 16]))
def test_random_sequences_keep_integrity_and_leak_nothing(
    ops: list[tuple[str, int, int]], device: int, host: int, bs: int
) -> None:
    bm = BlockManager(device, host, bs)
    reqs: dict[str, Request] = {}
    bm.begin_iteration()
    for op, i, n in ops:
        rid = f"r{i}"
        r = reqs.get(rid)
        if op == "admit" and r is None:
            r = Request(rid, [1] * n, SamplingParams(), 0.0)
            if bm.can_allocate(r, n):
                bm.allocate(r, n)
                r.state = RequestState.RUNNING
                r.num_computed_tokens = n
                reqs[rid] = r
        elif r is None:
            continue
        elif op == "grow" and r.state is RequestState.RUNNING:
            if bm.can_allocate(r, n):
                bm.allocate(r, n)
                r.num_computed_tokens += n
        elif op == "rotate_out" and r.state is RequestState.RUNNING:
            # The scheduler's one-call forms equal the check/act pairs they stand for.
            assert bm.preemption_blocks(r, True) == (
                bm.swap_out_cost(r), *bm.released_by_preempting(r, True))
            assert bm.preemption_blocks(r, False) == (0, *bm.released_by_preempting(r, False))
            twin = copy.deepcopy(bm)
            moved = twin.swap_out(r) if twin.can_swap_out(r) else None
            assert bm.try_swap_out(r) == moved
            assert (bm.tables, bm._open, bm.device._free) == (
                twin.tables, twin._open, twin.device._free)
            if moved is not None:
                r.state = RequestState.ROTARY
            else:
                bm.drop_to_recompute(r)
                r.state = RequestState.WAITING
                del reqs[rid]
        elif op == "rotate_in" and r.state is RequestState.ROTARY:
            if bm.can_swap_in(r, 1) and bm.blocks_for(r.num_computed_tokens + 1) <= bm.num_free_device:
                bm.swap_in(r)
                bm.allocate(r, 1)
                r.state = RequestState.RUNNING
        elif op == "finish":
            bm.free(r)
            r.state = RequestState.FINISHED
            del reqs[rid]
        elif op == "eager":
            running = [x for x in reqs.values() if x.state is RequestState.RUNNING]
            bm.eager_copy(running, budget=n, host_reserve=0)
        elif op == "fence":
            plan = bm.end_iteration()
            if plan is not None:
                bm.complete(plan.fence)
            bm.begin_iteration()
        bm.check_integrity(reqs)
    for r in list(reqs.values()):
        bm.free(r)
    plan = bm.end_iteration()
    if plan is not None:
        bm.complete(plan.fence)
    bm.check_integrity({})
    assert bm.num_free_device == device
    assert bm.num_free_host == host
