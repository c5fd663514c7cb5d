"""Automatic prefix caching with the token-level KV checker: shared blocks are never
written, freed or reused while referenced; rotation of sharing requests; the host tier as
the second level; recovery drops lost tiers; a property test over random operations."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.policy import POLICY_NAMES, make_policy
from scheduler_svc.prefix_cache import chain_hash, root_hash
from scheduler_svc.request import Request, RequestState, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from tests.kvcheck import CheckingExecutor, KVStore, assert_writes_private
from tests.test_scheduler import FakeClock, expected, run_engine, workload
from tests.test_scheduler_recovery import GARBAGE, wipe

BS = 4


def test_names_chain_over_the_prefix_and_the_model() -> None:
    a, b = root_hash("model-a"), root_hash("model-b")
    assert a != b
    x = chain_hash(a, [1, 2, 3, 4])
    assert x == chain_hash(a, [1, 2, 3, 4])
    assert x != chain_hash(b, [1, 2, 3, 4])  # another model: no match
    assert chain_hash(x, [5, 6, 7, 8]) != chain_hash(chain_hash(a, [1, 2, 3, 9]), [5, 6, 7, 8])


class Stepper:
    """The serial step by hand, with the KV checker: add requests when you like."""

    def __init__(self, device: int, host: int, policy: str = "lvf", eager: int = 8,
                 caching: bool = True, max_batched_tokens: int = 32) -> None:
        self.clock = FakeClock()
        self.sched = Scheduler(
            SchedulerConfig(num_device_blocks=device, num_host_blocks=host, block_size=BS,
                            max_batched_tokens=max_batched_tokens, eager_budget_blocks=eager,
                            enable_prefix_caching=caching),
            make_policy(policy), clock=self.clock)
        self.store = KVStore(device, host, BS)
        self.truth: dict[str, list[int]] = {}
        self.exe = CheckingExecutor(self.store, self.truth)
        self.out: dict[str, list[int]] = {}
        self.plans: list = []

    def add(self, rid: str, prompt: list[int], n: int) -> Request:
        self.truth[rid] = list(prompt)
        self.out[rid] = []
        req = Request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True),
                      arrival_time=self.clock.t)
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        s = self.sched
        out = s.schedule()
        assert_writes_private(s, out)
        if out.transfers is not None:
            self.plans.append(out.transfers)
            self.store.transfer(out.transfers)
            s.complete_transfer(out.transfers.fence)
        for ev in s.update_from_output(out, self.exe.execute(out.chunks)):
            self.out[ev.request_id] += ev.new_token_ids
        s.check_integrity()
        self.clock.t += 0.01

    def run(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("no progress")

    def check(self) -> None:
        for rid, prompt in self.truth.items():
            n = len(self.out[rid])
            assert self.out[rid] == expected(prompt, n), rid


def test_the_same_prompt_twice_is_served_from_the_device_tier() -> None:
    e = Stepper(device=32, host=0)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks
    e.add("a", prompt, 5)
    e.run()
    b = e.add("b", prompt, 5)
    e.run()
    e.check()
    assert e.out["a"] == e.out["b"] == expected(prompt, 5)
    st = e.sched.stats
    assert st.prefix_cache_hits == 16  # 4 full blocks, the last 2 tokens computed
    assert st.prefix_cache_queries == 36 and st.prefix_cache_host_hits == 0
    assert b.num_cached_tokens == 16 and b.summary(0.0)["cached_tokens"] == 16
    bm = e.sched.bm
    assert bm.num_cached_device > 0 and bm.num_free_device == 32  # cached blocks count free


def test_a_prompt_that_is_all_cached_still_computes_its_last_token() -> None:
    e = Stepper(device=32, host=0)
    prompt = list(range(16))  # exactly 4 blocks: 3 may be reused, the 4th is computed
    e.add("a", prompt, 3)
    e.run()
    b = e.add("b", prompt, 3)
    e.run()
    e.check()
    assert b.num_cached_tokens == 12


def test_requests_sharing_a_prefix_share_its_blocks_and_one_eager_copy() -> None:
    e = Stepper(device=40, host=40, eager=32)
    head = list(range(500, 520))  # 5 full blocks
    e.add("a", head + [1, 2], 30)
    for _ in range(3):
        e.step()  # a's prefill settles: its full blocks get names
    e.add("b", head + [7, 8, 9], 30)
    e.add("c", head + [3], 30)
    e.step()
    bm = e.sched.bm
    ta, tb, tc = (bm.device_table(r) for r in "abc")
    assert ta[:5] == tb[:5] == tc[:5]  # one copy of the prefix on the device
    assert all(bm._dev_ref[d] == 3 for d in ta[:5])
    assert len(set(ta[5:]) | set(tb[5:]) | set(tc[5:])) == len(ta[5:]) + len(tb[5:]) + len(tc[5:])
    e.run()
    e.check()
    # Each shared block was copied to the host once: one eager copy per device block.
    copied = [d for p in e.plans for d, _ in p.eager]
    assert len(copied) == len(set(copied)), "a shared block was copied twice"
    assert e.sched.stats.prefix_cache_hits == 40


def test_rotating_out_a_sharing_request_frees_only_what_no_one_else_holds() -> None:
    e = Stepper(device=40, host=40, eager=0)
    head = list(range(300, 316))  # 4 full blocks
    e.add("a", head + [1], 30)
    for _ in range(3):
        e.step()
    b = e.add("b", head + [2, 3, 4, 5, 6], 30)
    e.step()
    e.step()
    sched, bm = e.sched, e.sched.bm
    shared = bm.device_table("a")[:4]
    own = [d for d in bm.device_table("b") if d not in shared]
    assert own and bm.device_table("b")[:4] == shared
    bm.begin_iteration()
    copied, freed = bm.swap_out(b)
    sched.running.remove(b)
    b.set_state(RequestState.ROTARY, 0.0)
    sched.rotary.append(b)
    plan = bm.end_iteration()
    assert plan is not None
    # b's own blocks are copied out and released; the shared ones stay, referenced by a.
    assert {d for d, _ in plan.swap_out} >= set(own)
    assert all(bm._dev_ref[d] == 1 for d in shared)
    assert copied == 6 and freed == 0  # eager copies are off: all six are copied out
    assert not any(bm.device.is_free(d) for d in own)  # not before their copy has read them
    e.store.transfer(plan)
    bm.complete(plan.fence)
    assert all(bm.device.is_free(d) for d in own)
    sched.check_integrity()
    e.run()
    e.check()


def test_host_tier_serves_a_prefix_the_device_tier_evicted() -> None:
    """A tiny device pool: by the time a prompt comes back its device blocks are long
    evicted, but their eager host copies are still cached: it is copied in, not
    recomputed, and the output is unchanged."""
    e = Stepper(device=12, host=64, eager=16)
    long = list(range(700, 740))  # 10 full blocks
    e.add("a", long, 4)
    e.run()
    rng = random.Random(5)
    for i in range(6):  # unrelated prompts push a's blocks out of the device tier
        e.add(f"x{i}", [rng.randrange(1000) for _ in range(30)], 6)
        e.run()
    bm = e.sched.bm
    st = e.sched.stats
    before = (st.prefix_cache_hits, st.prefix_cache_host_hits)
    again = e.add("again", long, 4)
    e.run()
    e.check()
    assert st.prefix_cache_hits - before[0] == 0  # the device tier alone would miss
    assert st.prefix_cache_host_hits - before[1] == 36  # 9 blocks copied in instead
    assert again.num_cached_tokens == 36
    assert sum(len(p.swap_in) for p in e.plans) >= 9
    assert bm.num_free_device == 12 and bm.num_free_host == 64


def test_host_tier_eviction_is_lru_and_never_takes_a_referenced_copy() -> None:
    """The host tier holds three prompts' copies; the least recently used goes first, a copy
    used again moves to the back, and the oldest copies survive while a request holds them."""
    e = Stepper(device=64, host=6, eager=16)  # a roomy device tier: only the host evicts
    bm = e.sched.bm
    prompts = {k: list(range(base, base + 9)) for k, base in
               (("a", 100), ("b", 200), ("c", 300), ("d", 400), ("e", 500))}  # 2 full blocks

    def cached(k: str) -> bool:
        """Whether the host tier still has prompt k's two full blocks, by name."""
        names, parent = [], root_hash("")
        for i in range(2):
            parent = chain_hash(parent, prompts[k][i * BS:(i + 1) * BS])
            names.append(parent)
        found = [h in bm.host_cache.by_hash for h in names]
        assert found[0] == found[1], f"{k}: half evicted"
        return found[0]

    for k in "abc":  # released in the order a, b, c: the host tier is then full
        e.add(k, prompts[k], 2)
        e.run()
    assert bm.host.num_free == 0 and all(cached(k) for k in "abc")
    e.add("a again", prompts["a"], 2)  # uses a's copies: a is now the most recently used
    e.run()
    e.add("d", prompts["d"], 2)  # needs two host blocks: b's go, not a's (released first)
    e.run()
    assert not cached("b") and cached("c") and cached("a") and cached("d")
    e.add("e", prompts["e"], 2)  # then c's
    e.run()
    assert not cached("c") and cached("a") and cached("d") and cached("e")
    # a's copies are now the oldest; a request holding them writes new blocks whose eager
    # copies need room: d's go, a's stay.
    e.add("a held", prompts["a"], 12)
    e.run()
    assert e.sched.stats.eager_blocks > 8
    assert cached("a") and not cached("d") and cached("e")
    e.check()  # and nothing read a block evicted under it


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_shared_prefixes_under_rotation_are_exact(policy: str) -> None:
    prompts, lens = workload(30, seed=4, shared=True)
    arrivals = [i * 0.02 for i in range(30)]
    outs, sched, _ = run_engine(prompts, lens, policy=policy, device_blocks=22, host_blocks=200,
                                arrivals=arrivals, caching=True)
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == expected(p, lens[i]), f"r{i} under {policy}"
    st = sched.stats
    assert st.prefix_cache_hits > 0
    if policy != "fcfs":
        assert st.rotations > 0
    assert sched.bm.num_free_device == 22 and sched.bm.num_free_host == 200


def test_a_rotary_request_swaps_in_only_what_the_device_no_longer_caches() -> None:
    prompts, lens = workload(30, seed=4, shared=True)
    arrivals = [i * 0.02 for i in range(30)]
    _, sched, _ = run_engine(prompts, lens, policy="lvf", device_blocks=22, host_blocks=200,
                             arrivals=arrivals, caching=True)
    assert sched.stats.swap_in_cached_blocks > 0


# -- recovery: a lost tier is dropped, never served stale ------------------------------------
def _warm(device: int = 24, host: int = 64) -> tuple[Stepper, list[int]]:
    e = Stepper(device=device, host=host, eager=16)
    prompt = list(range(40, 64))  # 6 full blocks
    e.add("a", prompt, 3)
    e.run()
    return e, prompt


def test_worker_restart_drops_the_device_tier_and_keeps_the_host_tier() -> None:
    e, prompt = _warm()
    bm = e.sched.bm
    assert bm.num_cached_device > 0 and bm.num_cached_host > 0
    wipe(e.store.device)  # a new worker: every device block is garbage
    e.sched.device_lost()
    assert len(bm.dev_cache) == 0 and bm.num_cached_host > 0
    e.add("b", prompt, 3)
    e.run()
    e.check()  # served from the host tier, and right (the checker reads the garbage if not)
    assert e.sched.stats.prefix_cache_host_hits == 20


def test_kvmem_restart_drops_the_host_tier() -> None:
    e, prompt = _warm()
    bm = e.sched.bm
    wipe(e.store.host)
    e.sched.host_lost()
    assert len(bm.host_cache) == 0 and bm.num_free_host == 64
    for d in list(bm.dev_cache.parked):  # and the device tier is evicted: nothing left
        bm.dev_cache.evict(d)
        bm.device.free([d])
    e.add("b", prompt, 3)
    e.run()
    e.check()
    assert e.sched.stats.prefix_cache_host_hits == 0


def test_blocks_a_failed_copy_wrote_lose_their_names() -> None:
    e, prompt = _warm(device=8, host=64)
    sched, bm = e.sched, e.sched.bm
    for d in list(bm.dev_cache.parked):  # only the host tier has the prompt
        bm.dev_cache.evict(d)
        bm.device.free([d])
    e.add("b", prompt, 3)
    out = sched.schedule()  # b's prefix is copied in (H2D) ...
    plan = out.transfers
    assert plan is not None and len(plan.swap_in) == 5
    sched.complete_transfer(plan.fence)  # ... but the copy failed: nothing was written
    wipe(e.store.device, {d for _, d in plan.swap_in})
    sched.kv_lost(failed=plan)
    assert not any(d in bm.dev_cache.hash_of for _, d in plan.swap_in)
    sched.check_integrity()
    e.run()
    e.check()
    assert e.out["b"] == expected(prompt, 3)


def test_the_checker_sees_a_stale_device_tier() -> None:
    """The recovery test above can fail: keeping the device tier's names across a worker
    restart serves garbage, and the checker notices."""
    e, prompt = _warm()
    bm = e.sched.bm
    names = dict(bm.dev_cache.hash_of), list(bm.dev_cache.parked)
    wipe(e.store.device, set(names[1]))
    e.sched.device_lost()
    for d in names[1]:  # put the lost names back, as a buggy recovery would
        bm.device._is_free[d] = False
        bm.device._free.remove(d)
        bm.dev_cache.name(d, names[0][d])
        bm.dev_cache.park(d, 0)
    e.add("b", prompt, 3)
    with pytest.raises(AssertionError, match="KV context differs"):
        e.run()
    assert GARBAGE in e.store.device[names[1][0]]


def test_a_request_may_reuse_blocks_a_swap_in_of_the_same_plan_fills() -> None:
    """A rotary request swaps in (H2D into fresh blocks, named at once) and a request with
    the same prefix, admitted in the same plan, reuses those blocks: its batch runs after
    the plan's swap-ins (the engine step's rule), so it reads them filled."""
    m = _Model(device=16, host=16, bs=4)
    bm = m.bm
    prefix = list(range(200, 212))  # 3 full blocks
    m.admit("a", prefix + [1, 2])
    m.fence()
    a = m.reqs["a"]
    bm.eager_copy([a], budget=8, host_reserve=0)
    m.fence()
    bm.swap_out(a)
    a.state = RequestState.ROTARY
    m.fence()
    for d in list(bm.dev_cache.parked):  # the device tier forgets a's blocks
        bm.dev_cache.evict(d)
        bm.device.free([d])
    bm.swap_in(a)
    a.state = RequestState.RUNNING
    filled = {d for _, d in bm._open.swap_in}  # type: ignore[union-attr]
    m.admit("b", prefix + [7])
    shared = bm.device_table("b")[:3]
    assert shared == bm.device_table("a")[:3] and set(shared) <= filled
    m.fence()  # copies, then the batch: b reads its prefix from the swapped-in blocks
    bm.check_integrity(m.reqs)


# -- a property test over random operations on the block manager -----------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "share", "append", "rotate_out", "rotate_in", "abort",
                         "finish", "eager", "fence"]),
        st.integers(0, 5),  # which request
        st.integers(1, 12),  # tokens
    ),
    min_size=40,
    max_size=200,
)


class _Model:
    """Requests driven through the block manager by hand, KV mirrored in a KVStore: a
    plan's copies happen at its fence, then the chunks computed in it write their tokens."""

    def __init__(self, device: int, host: int, bs: int) -> None:
        self.bm = BlockManager(device, host, bs, prefix_caching=True)
        self.store = KVStore(device, host, bs)
        self.bs = bs
        self.reqs: dict[str, Request] = {}
        self.writes: list[tuple[Request, int, int]] = []  # (request, start, end) this plan
        self.next_tok = 0
        # As the scheduler plans: rotated out in this plan, not back in it; admitted or
        # swapped in in this plan, not rotated out in it.
        self.displaced: set[str] = set()
        self.admitted: set[str] = set()
        self.bm.begin_iteration()

    def tokens(self, n: int) -> list[int]:
        self.next_tok += n
        return [(self.next_tok - i) % 997 for i in range(n)]

    def compute(self, r: Request, n: int) -> None:
        r.num_computed_tokens += n
        r.num_inflight_tokens += n
        self.writes.append((r, r.num_computed_tokens - n, r.num_computed_tokens))

    def admit(self, rid: str, prompt: list[int]) -> None:
        r = Request(rid, prompt, SamplingParams(), 0.0)
        n, need, cost = self.bm.admission(r, 1 << 20)
        room = self.bm.num_free_for_swap_in if cost else self.bm.num_free_for_compute
        if n <= 0 or need > room:
            self.bm.free(r)
            return
        self.bm.attach_prefix(r)
        self.bm.allocate(r, n)
        self.compute(r, n)
        r.state = RequestState.RUNNING
        self.reqs[rid] = r
        self.admitted.add(rid)

    def fence(self) -> None:
        bm, store, bs = self.bm, self.store, self.bs
        plan = bm.end_iteration()
        if plan is not None:
            store.transfer(plan)
            bm.complete(plan.fence)
        for r, start, end in self.writes:
            if self.reqs.get(r.request_id) is not r or r.state is not RequestState.RUNNING:
                continue
            table = bm.device_table(r.request_id)
            for p in range(start, end):
                d = table[p // bs]
                if d in bm.dev_cache.hash_of or bm._dev_ref[d] != 1:
                    raise AssertionError(f"{r.request_id} writes shared block {d}")
                store.device[d][p % bs] = r.token_id_at(p)
        self.writes = []
        self.displaced.clear()
        self.admitted.clear()
        for r in self.reqs.values():
            r.num_inflight_tokens = 0
            bm.cache_full_blocks(r)
        self.check_contents()
        bm.begin_iteration()

    def check_contents(self) -> None:
        """Every running request reads its own tokens through its device table, every rotary
        one through its host copies: nothing it references was freed and reused."""
        bm, store, bs = self.bm, self.store, self.bs
        for r in self.reqs.values():
            t = bm._tables[r.request_id]
            for p in range(r.num_computed_tokens):
                if r.state is RequestState.RUNNING:
                    got = store.device[t.device[p // bs]][p % bs]  # type: ignore[index]
                else:
                    got = store.host[t.host[p // bs]][p % bs]  # type: ignore[index]
                assert got == r.token_id_at(p), f"{r.request_id} lost its KV at {p}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, device=st.integers(4, 24), host=st.integers(0, 24),
       bs=st.sampled_from([1, 2, 4]), data=st.data())
def test_random_operations_with_sharing_keep_integrity(ops, device, host, bs, data) -> None:  # noqa: ANN001
    heads = [data.draw(st.lists(st.integers(0, 996), max_size=10)) for _ in range(2)]
    m = _Model(device, host, bs)
    bm, reqs = m.bm, m.reqs
    for op, i, n in ops:
        rid = f"r{i}"
        r = reqs.get(rid)
        if op in ("admit", "share") and r is None:
            if op == "share" and reqs:  # another live request's tokens so far, and more
                other = reqs[sorted(reqs)[i % len(reqs)]]
                base = other.token_ids_slice(0, other.num_prompt_tokens + other.num_output_tokens)
                prompt = base[: max(1, len(base) - n % 3)] + m.tokens(n % 3)
            else:
                prompt = heads[i % 2] + m.tokens(n)
            m.admit(rid, prompt)
        elif r is None:
            continue
        elif op == "append" and r.state is RequestState.RUNNING:
            if r.num_computed_tokens < r.num_tokens:
                continue  # its prompt is being computed; one chunk at a time here
            r.output_token_ids.extend(m.tokens(n))
            if bm.try_grow(r, n):
                m.compute(r, n)
            else:
                del r.output_token_ids[-n:]
        elif (op == "rotate_out" and r.state is RequestState.RUNNING and not r.num_inflight_tokens
              and rid not in m.admitted):
            if bm.can_swap_out(r):
                bm.swap_out(r)
                r.state = RequestState.ROTARY
                m.displaced.add(rid)  # as the scheduler: its D2H copy is in this plan
            else:
                bm.drop_to_recompute(r)
                del reqs[rid]
        elif op == "rotate_in" and r.state is RequestState.ROTARY and rid not in m.displaced:
            k, need, cost = bm.admission(r, 0)
            if need <= bm.num_free_for_swap_in:
                bm.swap_in(r)
                r.state = RequestState.RUNNING
                m.admitted.add(rid)
        elif op in ("abort", "finish"):
            bm.free(r)
            del reqs[rid]
        elif op == "eager":
            bm.eager_copy([x for x in reqs.values() if x.state is RequestState.RUNNING],
                          budget=n, host_reserve=0)
        elif op == "fence":
            m.fence()
        bm.check_integrity(reqs)
    m.fence()
    for r in list(reqs.values()):
        bm.free(r)
    reqs.clear()
    m.fence()
    bm.check_integrity({})
    assert bm.num_free_device == device and bm.num_free_host == host
    assert bm.pending_fences == []
