"""DuplexKV: every mode moves the right bytes, both directions at once, eager copies last.

The reference for a plan is what one thread produces running its D2H copies (swap-out,
eager), then its H2D copies (swap-in) — the engine must give the same bytes however it
overlaps them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import kvmem_svc.duplex as duplex
from common.contracts import TransferPlan
from kvmem_svc.copy import LocalCopyEngine, coalesce, copy_blocks
from kvmem_svc.duplex import DuplexEngine, Mode, TransferConflict, TransferError
from kvmem_svc.hostmem import allocate_host_pool, online_nodes
from kvmem_svc.layout import PoolGeometry

MODES = [m.value for m in Mode]
BLOCK = (3, 2, 4, 2, 8)  # layers, K/V, block_size, kv_heads, head_dim


def pools(n_dev: int = 16, n_host: int = 16, dtype: torch.dtype = torch.float32,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dev = torch.randn((n_dev, *BLOCK), generator=g).to(dtype)
    host = torch.randn((n_host, *BLOCK), generator=g).to(dtype)
    return dev, host


def expected(plan: TransferPlan, dev: torch.Tensor, host: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    d, h = dev.clone(), host.clone()
    for src, dst in plan.swap_out + plan.eager:
        h[dst] = d[src]
    for src, dst in plan.swap_in:
        d[dst] = h[src]
    return d, h


def run_and_check(engine: DuplexEngine, plan: TransferPlan) -> duplex.TransferTiming:
    want_d, want_h = expected(plan, engine.device_pool, engine.host_pool)
    timing = engine.transfer(plan)
    assert torch.equal(engine.device_pool, want_d)
    assert torch.equal(engine.host_pool, want_h)
    return timing


def random_plan(rng: random.Random, fence: int, n_dev: int, n_host: int,
                dependent: bool = False) -> TransferPlan:
    """A plan that reuses the same ids across directions and tiers.

    Device ids split into read (swap-out/eager) and written (swap-in) sets, host ids the
    other way round, drawn independently — so an id is often a device block read in one
    direction and a host block read or written in the other. With `dependent`, some
    swap-ins also write a device block the plan reads or read a host block it writes (what
    the block manager emits when it reuses a rotated-out block in the same iteration).
    """
    devs = rng.sample(range(n_dev), rng.randint(0, n_dev))
    hosts = rng.sample(range(n_host), rng.randint(0, n_host))
    k_dev, k_host = rng.randint(0, len(devs)), rng.randint(0, len(hosts))
    d_read, d_write = devs[:k_dev], devs[k_dev:]
    h_write, h_read = hosts[:k_host], hosts[k_host:]
    d2h = list(zip(d_read, h_write))
    if dependent:
        d_write += rng.sample(d_read, rng.randint(0, len(d_read)))
        h_read += rng.sample([h for _, h in d2h], rng.randint(0, len(d2h)))
    rng.shuffle(d_write), rng.shuffle(h_read)
    n_eager = rng.randint(0, len(d2h))
    h2d = list(zip(h_read, d_write))
    return TransferPlan(fence=fence, swap_out=d2h[n_eager:], swap_in=h2d, eager=d2h[:n_eager])


# -- correctness in every mode --------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_device_host_device(mode: str, dtype: torch.dtype) -> None:
    dev, host = pools(dtype=dtype)
    original = dev.clone()
    with DuplexEngine(dev, host, mode) as engine:
        # Rotate out blocks 0..5 (scattered host slots), then back into other device blocks.
        out = [(0, 9), (1, 3), (2, 4), (3, 5), (4, 15), (5, 0)]
        run_and_check(engine, TransferPlan(1, swap_out=out[:4], eager=out[4:]))
        back = [(h, 10 + i) for i, (_, h) in enumerate(out)]
        run_and_check(engine, TransferPlan(2, swap_in=back))
    for i, (d, _) in enumerate(out):
        assert torch.equal(dev[10 + i], original[d])


@pytest.mark.parametrize("mode", MODES)
def test_both_directions_in_one_plan(mode: str) -> None:
    dev, host = pools(32, 32)
    plan = TransferPlan(
        7,
        swap_out=[(0, 1), (1, 2), (2, 3), (9, 20)],  # a run of three, then a stray block
        swap_in=[(5, 4), (6, 5), (30, 31), (31, 30)],
        eager=[(12, 13), (13, 14)],
    )
    with DuplexEngine(dev, host, mode) as engine:
        timing = run_and_check(engine, plan)
    assert timing.fence == 7 and timing.mode == mode


@pytest.mark.parametrize("mode", MODES)
def test_same_ids_in_both_directions(mode: str) -> None:
    """Device 1 and 3 go out to host 2 and 4 while host 1 and 3 come in to device 2 and 4."""
    dev, host = pools()
    plan = TransferPlan(1, swap_out=[(1, 2), (3, 4)], swap_in=[(1, 2), (3, 4)])
    with DuplexEngine(dev, host, mode) as engine:
        run_and_check(engine, plan)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dependent", [False, True])
def test_many_random_plans_match_the_reference(mode: str, dependent: bool) -> None:
    rng = random.Random(1)
    dev, host = pools(24, 24)
    ordered = 0
    with DuplexEngine(dev, host, mode, strict=False) as engine:
        for fence in range(1, 41):
            ordered += run_and_check(engine, random_plan(rng, fence, 24, 24, dependent)
                                     ).ordered_blocks
    assert (ordered > 0) == dependent


def test_pipelined_plans_match_the_reference() -> None:
    """Plans submitted back to back (no wait between) produce what running them in order
    would, even where a later plan touches blocks an earlier one still copies."""
    rng = random.Random(2)
    dev, host = pools(24, 24)
    want_d, want_h = dev.clone(), host.clone()
    plans = [random_plan(rng, f, 24, 24, dependent=f % 2 == 0) for f in range(1, 31)]
    for p in plans:
        want_d, want_h = expected(p, want_d, want_h)
    with DuplexEngine(dev, host, strict=False) as engine:
        handles = [engine.submit(p) for p in plans]
        for h in handles:
            engine.wait(h)
    assert torch.equal(dev, want_d) and torch.equal(host, want_h)


# -- plans whose copies would race ---------------------------------------------------------------
DEPENDENT = [  # a swap-in that depends on a D2H copy of its own plan
    (TransferPlan(3, swap_out=[(4, 0)], swap_in=[(1, 4)]), "swap-in writes device block 4"),
    (TransferPlan(3, eager=[(4, 0)], swap_in=[(1, 4)]), "swap-in writes device block 4"),
    (TransferPlan(3, swap_out=[(2, 6)], swap_in=[(6, 3)]), "swap-in reads host block 6"),
]
INVALID = [
    (TransferPlan(3, swap_out=[(2, 6)], eager=[(3, 6)]), "host block 6 is written by two"),
    (TransferPlan(3, swap_in=[(1, 5), (2, 5)]), "device block 5 is written by two"),
    (TransferPlan(3, swap_out=[(16, 0)]), "swap-out source block 16 out of range"),
    (TransferPlan(3, swap_in=[(0, -1)]), "swap-in destination block -1 out of range"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("plan", "message"), INVALID + DEPENDENT)
def test_racy_or_bad_plan_is_refused_and_touches_nothing(
    mode: str, plan: TransferPlan, message: str
) -> None:
    dev, host = pools()
    before = dev.clone(), host.clone()
    with DuplexEngine(dev, host, mode) as engine, pytest.raises(TransferConflict, match=message):
        engine.submit(plan)
    assert torch.equal(dev, before[0]) and torch.equal(host, before[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("plan", "message"), INVALID)
def test_invalid_plan_is_refused_even_when_not_strict(
    mode: str, plan: TransferPlan, message: str
) -> None:
    dev, host = pools()
    with (DuplexEngine(dev, host, mode, strict=False) as engine,
          pytest.raises(TransferConflict, match=message)):
        engine.submit(plan)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("plan", "message"), DEPENDENT)
def test_dependent_swap_in_runs_after_the_copy_it_depends_on(
    mode: str, plan: TransferPlan, message: str
) -> None:
    dev, host = pools()
    with DuplexEngine(dev, host, mode, strict=False) as engine:
        timing = run_and_check(engine, plan)
    assert timing.ordered_blocks == 1 and timing.swap_in_blocks == 1


def test_block_manager_plan_reusing_a_rotated_out_block() -> None:
    """What the block manager emitted before its same-iteration reuse fix (`superinfer
    generate`, LVF, 8 device blocks): request A rotates out device block 5; request B
    borrows it for compute, is rotated out too and trims it back to the free list; a
    swap-in gets it — all in one iteration. Refused by default; ordered when not strict."""
    dev, host = pools()
    plan = TransferPlan(8, swap_out=[(5, 2), (4, 3)], swap_in=[(1, 5)])
    with DuplexEngine(dev, host) as engine, pytest.raises(TransferConflict, match="block 5"):
        engine.submit(plan)
    old5 = dev[5].clone()
    with DuplexEngine(dev, host, strict=False) as engine:
        assert run_and_check(engine, plan).ordered_blocks == 1
    assert torch.equal(host[2], old5) and torch.equal(dev[5], host[1])


# -- eager copies: lowest priority on the D2H lane, never in the swap-ins' way ------------------------
class Gate:
    """Wraps the run copier: records which step ran on which thread, can hold a step back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, int]] = []  # (thread name, first source block)
        self.hold: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        real = duplex.copy_runs

        def copy_runs(src, dst, runs, geo, use_memmove):  # type: ignore[no-untyped-def]
            first = runs[0][0]
            if first in self.started:
                self.started[first].set()
            if first in self.hold:
                assert self.hold[first].wait(10), "test gate never opened"
            out = real(src, dst, runs, geo, use_memmove)
            self.log.append((threading.current_thread().name, first))
            return out

        monkeypatch.setattr(duplex, "copy_runs", copy_runs)

    def block(self, first_src: int) -> threading.Event:
        self.hold[first_src] = threading.Event()
        self.started[first_src] = threading.Event()
        return self.hold[first_src]


def test_swap_in_does_not_wait_for_eager_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    release = gate.block(8)  # the eager copy reads device block 8
    dev, host = pools()
    plan = TransferPlan(1, swap_out=[(1, 1)], eager=[(8, 8)], swap_in=[(12, 12)])
    want = expected(plan, dev, host)
    with DuplexEngine(dev, host) as engine:
        handle = engine.submit(plan)
        assert gate.started[8].wait(10)  # eager is running (and stuck)...
        deadline = time.monotonic() + 10
        while ("duplexkv-h2d", 12) not in gate.log and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ("duplexkv-h2d", 12) in gate.log  # ...yet the swap-in finished
        assert not handle.done()  # the fence covers the eager copy too
        release.set()
        timing = engine.wait(handle)
    assert torch.equal(dev, want[0]) and torch.equal(host, want[1])
    assert gate.log.index(("duplexkv-d2h", 1)) < gate.log.index(("duplexkv-d2h", 8))
    assert timing.eager_blocks == 1 and timing.eager_s > 0


def test_eager_copies_yield_to_later_swap_outs(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    release = gate.block(0)  # plan 1's swap-out holds the D2H lane
    dev, host = pools()
    with DuplexEngine(dev, host) as engine:
        h1 = engine.submit(TransferPlan(1, swap_out=[(0, 0)], eager=[(1, 1)]))
        assert gate.started[0].wait(10)
        h2 = engine.submit(TransferPlan(2, swap_out=[(2, 2)], eager=[(3, 3)]))
        release.set()
        engine.wait(h1), engine.wait(h2)
    d2h = [first for name, first in gate.log if name == "duplexkv-d2h"]
    assert d2h == [0, 2, 1, 3]  # both urgent swap-outs before either eager copy
    for d in range(4):
        assert torch.equal(host[d], dev[d])


def test_ordered_swap_in_follows_the_d2h_copies_on_their_lane(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    dev, host = pools()
    plan = TransferPlan(1, swap_out=[(5, 2)], eager=[(6, 7)], swap_in=[(1, 5), (9, 9)])
    with DuplexEngine(dev, host, strict=False) as engine:
        run_and_check(engine, plan)
    assert ("duplexkv-h2d", 9) in gate.log  # the independent swap-in ran on its own lane
    d2h = [first for name, first in gate.log if name == "duplexkv-d2h"]
    assert d2h == [5, 6, 1]  # swap-out, eager, then the swap-in that overwrites block 5


def test_clashing_plan_in_flight_waits_for_the_earlier_one(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    release = gate.block(4)
    dev, host = pools()
    original = dev[4].clone()
    with DuplexEngine(dev, host) as engine:
        h1 = engine.submit(TransferPlan(1, swap_out=[(4, 0)]))  # reads device block 4 (held)
        assert gate.started[4].wait(10)
        submitted = threading.Event()
        result: list[duplex.TransferHandle] = []

        def second() -> None:  # writes device block 4: must not start before plan 1 read it
            result.append(engine.submit(TransferPlan(2, swap_in=[(9, 4)])))
            submitted.set()

        t = threading.Thread(target=second)
        t.start()
        assert not submitted.wait(0.3)
        release.set()
        t.join(10)
        engine.wait(h1), engine.wait(result[0])
    assert torch.equal(host[0], original)
    assert torch.equal(dev[4], host[9])


# -- timing, errors, lifecycle ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_timing_is_filled(mode: str) -> None:
    dev, host = pools(16, 16)
    geo = PoolGeometry.of(dev)
    plan = TransferPlan(5, swap_out=[(0, 0), (1, 1), (7, 3)], swap_in=[(9, 9)], eager=[(4, 6)])
    with DuplexEngine(dev, host, mode) as engine:
        t = engine.transfer(plan)
    assert (t.fence, t.swap_out_blocks, t.swap_in_blocks, t.eager_blocks) == (5, 3, 1, 1)
    assert t.bytes_d2h == 4 * geo.block_bytes and t.bytes_h2d == geo.block_bytes
    assert geo.block_bytes == 3 * 2 * 4 * 2 * 8 * 4
    want_copies = 5 * geo.segments_per_block if mode == "layer-first" else 4  # (0,0)+(1,1) coalesce
    assert t.copies == want_copies
    assert t.d2h_s > 0 and t.h2d_s > 0 and t.eager_s > 0 and t.total_s > 0
    assert t.gbps > 0 and t.overlap > 0
    assert t.as_dict()["bytes_d2h"] == t.bytes_d2h


def test_empty_plan_is_done_at_once() -> None:
    dev, host = pools()
    with DuplexEngine(dev, host) as engine:
        h = engine.submit(TransferPlan(3))
        assert h.done()
        assert engine.wait(h).total_s == 0.0


def test_failed_copy_raises_on_wait_and_the_lane_lives_on(monkeypatch: pytest.MonkeyPatch) -> None:
    real = duplex.copy_runs

    def flaky(src, dst, runs, geo, use_memmove):  # type: ignore[no-untyped-def]
        if runs[0][0] == 13:
            raise OSError("simulated copy failure")
        return real(src, dst, runs, geo, use_memmove)

    monkeypatch.setattr(duplex, "copy_runs", flaky)
    dev, host = pools()
    with DuplexEngine(dev, host) as engine:
        with pytest.raises(TransferError, match="fence 1 failed: simulated"):
            engine.transfer(TransferPlan(1, swap_in=[(13, 2)]))
        run_and_check(engine, TransferPlan(2, swap_in=[(3, 2)], swap_out=[(5, 5)]))


def test_strided_pools_use_torch_copies() -> None:
    wide_dev = torch.randn(8, 3, 2, 4, 2, 16)
    wide_host = torch.zeros(8, 3, 2, 4, 2, 16)
    dev, host = wide_dev[..., :8], wide_host[..., 8:]  # block-first views, not contiguous
    for mode in MODES:
        with DuplexEngine(dev, host, mode) as engine:
            assert "torch copy_" in engine.describe()
            run_and_check(engine, TransferPlan(1, swap_out=[(0, 1), (1, 2)], swap_in=[(5, 6)]))
    with pytest.raises(ValueError, match="contiguous"):
        DuplexEngine(dev, host, cpu_copy="memmove")


@pytest.mark.parametrize("mode", MODES)
def test_torch_copy_path_matches(mode: str) -> None:
    rng = random.Random(3)
    dev, host = pools(12, 12)
    with DuplexEngine(dev, host, mode, cpu_copy="torch") as engine:
        for fence in range(1, 11):
            run_and_check(engine, random_plan(rng, fence, 12, 12))


def test_bad_construction() -> None:
    dev, host = pools()
    with pytest.raises(ValueError, match="unknown transfer mode 'sideways'"):
        DuplexEngine(dev, host, "sideways")
    with pytest.raises(ValueError, match="block shape"):
        DuplexEngine(dev, torch.zeros(4, 3, 2, 4, 2, 4))
    with pytest.raises(ValueError, match="block shape and dtype"):
        DuplexEngine(dev, host.to(torch.bfloat16))
    with pytest.raises(ValueError, match="KV pool is"):
        DuplexEngine(torch.zeros(4, 3, 3, 4), torch.zeros(4, 3, 3, 4))


def test_closed_engine_refuses_plans() -> None:
    dev, host = pools()
    engine = DuplexEngine(dev, host)
    engine.transfer(TransferPlan(1, swap_out=[(0, 0)]))
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(TransferPlan(2, swap_out=[(1, 1)]))


def test_lane_threads_stop_when_the_engine_goes_away() -> None:
    dev, host = pools()
    engine = DuplexEngine(dev, host)
    engine.transfer(TransferPlan(1, swap_out=[(0, 0)], swap_in=[(1, 1)]))
    threads = [lane.thread for lane in engine._lanes.values()]
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    del engine
    for t in threads:
        t.join(5)
        assert not t.is_alive()


# -- the in-process engine's adapter ---------------------------------------------------------------
def test_local_copy_engine_delegates_to_duplex() -> None:
    dev, host = pools()
    local = LocalCopyEngine(dev, host)  # the constructor `superinfer generate` uses
    assert local.engine.mode is Mode.DUPLEX
    plan = TransferPlan(4, swap_out=[(0, 0)], swap_in=[(3, 1)], eager=[(2, 5)])
    want = expected(plan, dev, host)
    timing = local.transfer(plan)
    assert timing.fence == 4
    assert torch.equal(dev, want[0]) and torch.equal(host, want[1])
    local.close()
    assert LocalCopyEngine(dev, host, mode="layer-first").engine.mode is Mode.LAYER_FIRST


def test_simple_copy_path_still_works() -> None:
    assert coalesce([(3, 7), (1, 5), (2, 6), (9, 1)]) == [(1, 5, 3), (9, 1, 1)]
    dev, host = pools()
    assert copy_blocks(dev, host, [(0, 4), (1, 5), (6, 0)]) == 2
    assert torch.equal(host[4:6], dev[0:2]) and torch.equal(host[0], dev[6])


# -- host memory ---------------------------------------------------------------------------------
def _smaps_rss_kib(addr: int) -> int | None:
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    start = text.find(f"{addr:x}-")
    if start < 0:
        return None
    for line in text[start:].splitlines()[1:]:
        if line.startswith("Rss:"):
            return int(line.split()[1])
    return None


def test_host_pool_allocated_prefaulted_and_described() -> None:
    mem = allocate_host_pool((2, 2, 16, 2, 64), torch.float32, num_blocks=40, numa_node="off",
                             pin="auto")
    try:
        assert mem.tensor.shape == (40, 2, 2, 16, 2, 64) and mem.num_blocks == 40
        assert mem.fits((2, 2, 16, 2, 64), torch.float32)
        assert not mem.fits((2, 2, 16, 2, 64), torch.bfloat16)
        assert mem.tensor.data_ptr() % 4096 == 0
        assert "pre-fault" in mem.description and "NUMA binding off" in mem.description
        assert "not pinned" in mem.description and not mem.pinned
        mem.tensor[3].fill_(2.5)  # copies may run while the pages are faulted in
        deadline = time.monotonic() + 30
        while True:  # every page becomes resident (in the background, or already)
            rss = _smaps_rss_kib(mem.tensor.data_ptr())
            if rss is None or rss * 1024 >= mem.tensor.numel() * 4:
                break
            assert time.monotonic() < deadline, f"{rss} KiB resident after 30 s"
            time.sleep(0.05)
        assert float(mem.tensor[3].sum()) == 2.5 * mem.tensor[3].numel()
        assert float(mem.tensor[4].abs().sum()) == 0.0  # populating wrote nothing
    finally:
        mem.close()


def test_host_pool_sized_in_gib() -> None:
    block = (2, 2, 16, 2, 64)  # 32 KiB blocks
    mem = allocate_host_pool(block, torch.float32, gib=1 / 1024, numa_node="off")
    assert mem.num_blocks == 32
    mem.close()
    empty = allocate_host_pool(block, torch.float32, num_blocks=0)
    assert empty.num_blocks == 0 and "empty" in empty.description
    with pytest.raises(ValueError, match="exactly one"):
        allocate_host_pool(block, torch.float32, num_blocks=1, gib=1.0)


def test_host_pool_numa_binding() -> None:
    nodes = online_nodes()
    if not nodes:
        pytest.skip("no NUMA information in sysfs")
    mem = allocate_host_pool((2, 2, 16, 2, 64), torch.float32, num_blocks=64,
                             numa_node=nodes[0])
    try:
        if "libnuma not found" in mem.description:
            pytest.skip("libnuma not installed")
        assert mem.numa_node == nodes[0] and f"node {nodes[0]}" in mem.description
        maps = Path("/proc/self/numa_maps")
        if maps.exists():
            line = next(ln for ln in maps.read_text().splitlines()
                        if ln.startswith(f"{mem.tensor.data_ptr():x} "))
            assert f"bind:{nodes[0]}" in line or f"prefer:{nodes[0]}" in line
    finally:
        mem.close()
    auto = allocate_host_pool((2, 2, 16, 2, 64), torch.float32, num_blocks=4)
    assert "NUMA" in auto.description  # says what it did, or why it did nothing
    auto.close()
    with pytest.raises(ValueError, match="does not exist"):
        allocate_host_pool((2, 2, 16, 2, 64), torch.float32, num_blocks=4, numa_node=999)
    with pytest.raises(ValueError, match="numa_node"):
        allocate_host_pool((2, 2, 16, 2, 64), torch.float32, num_blocks=4, numa_node="near")


def test_pin_true_without_cuda_is_an_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="pin=True needs CUDA"):
        allocate_host_pool((2, 2, 16, 2, 64), torch.float32, num_blocks=4, pin=True)


# -- the benchmark, tiny ------------------------------------------------------------------------
def test_bench_transfer_reports_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from superinfer.bench import transfer

    out = tmp_path / "t.json"
    args = argparse.Namespace(blocks=8, repeats=1, shapes="qwen2.5-32b,smollm2-135m", seed=0,
                              nt_threshold="default", copy_rows=False, json=str(out),
                              device="cpu")
    assert transfer.run(args) == 0
    data = json.loads(out.read_text())
    qwen = data["shapes"]["qwen2.5-32b"]
    assert qwen["block_bytes"] == 4 << 20 and qwen["segment_bytes"] == 32 << 10
    assert data["shapes"]["smollm2-135m"]["block_bytes"] == 720 << 10
    for shape in data["shapes"].values():
        for key in ("raw_gbps", "layer_first_gbps", "block_first_gbps", "duplex_gbps"):
            assert shape[key] > 0
        goals = {g["goal"]: g for g in shape["goals"]}
        assert set(goals) == {"block_first_share_of_raw", "block_first_over_layer_first",
                              "duplex_over_layer_first", "duplex_over_one_direction"}
        assert goals["duplex_over_layer_first"]["median"] == shape["duplex_vs_layer_first"]["median"]
        assert all(g["met"] == (g["median"] >= g["target"]) for g in goals.values())
        assert shape["block_first_d2h_gbps"] > 0 and shape["block_first_h2d_gbps"] > 0
    printed = capsys.readouterr().out
    assert "duplex" in printed and "block-first / layer-first" in printed


def test_bench_transfer_on_cuda_without_cuda_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from superinfer.bench import transfer

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    args = argparse.Namespace(blocks=8, repeats=1, shapes="smollm2-135m", seed=0,
                              nt_threshold="default", copy_rows=False, json=None, device="cuda")
    assert transfer.run(args) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_kvmem_reexecs_itself_with_the_copy_tunable() -> None:
    """glibc reads GLIBC_TUNABLES at start only: the daemon re-executes itself once with the
    non-temporal threshold added (same pid), keeping the user's other tunables."""
    import subprocess
    import sys

    from kvmem_svc.tunables import NT_KEY, NT_THRESHOLD, applies_here, with_nt_threshold

    env = with_nt_threshold({"GLIBC_TUNABLES": f"glibc.malloc.check=0:{NT_KEY}=1"}, "0x40000")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.check=0:{NT_KEY}=0x40000"
    if not applies_here():
        pytest.skip("glibc tunables apply to x86-64 Linux only")
    code = ("import os; from kvmem_svc.tunables import reexec_with_copy_tunables as r; "
            "print(os.getpid()); r(); print(os.getpid(), os.environ['GLIBC_TUNABLES'])")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("GLIBC_TUNABLES", "SUPERINFER_KVMEM_TUNED")}
    clean["GLIBC_TUNABLES"] = "glibc.malloc.check=0"
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True,
                         text=True, check=True).stdout.split()
    # The program runs twice (before and after the exec) in one process: the supervisor's
    # pid stays right. The second run has the threshold and does not exec again.
    assert len(out) == 4 and out[0] == out[1] == out[2]
    assert out[3] == f"glibc.malloc.check=0:{NT_KEY}={NT_THRESHOLD}"


# -- GPU (UNTESTED here: skipped without CUDA) ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_round_trip_every_mode(mode: str) -> None:
    mem = allocate_host_pool(BLOCK, torch.float32, num_blocks=32, pin=True)
    try:
        assert mem.pinned and mem.tensor.is_pinned()
        host = mem.tensor
        host.copy_(torch.randn_like(host))
        dev = torch.randn((32, *BLOCK), device="cuda")
        rng = random.Random(4)
        with DuplexEngine(dev, host, mode, strict=False) as engine:
            assert "cuda" in engine.describe()
            for fence in range(1, 21):
                plan = random_plan(rng, fence, 32, 32, dependent=fence % 2 == 0)
                want_d, want_h = expected(plan, dev.cpu(), host)
                engine.transfer(plan)
                assert torch.equal(dev.cpu(), want_d) and torch.equal(host, want_h)
    finally:
        mem.close()


@pytest.mark.gpu
def test_gpu_uses_batched_memcpy_where_the_runtime_has_it() -> None:
    from kvmem_svc.cuda_copy import CudaRuntime

    rt = CudaRuntime.load()
    assert rt is not None
    mem = allocate_host_pool(BLOCK, torch.float32, num_blocks=8, pin=True)
    try:
        with DuplexEngine(torch.zeros((8, *BLOCK), device="cuda"), mem.tensor) as engine:
            text = engine.describe()
        if min(rt.runtime_version, rt.driver_version) >= 12080:
            assert "cudaMemcpyBatchAsync" in text
        else:
            assert "copy_ loop" in text
    finally:
        mem.close()


@pytest.mark.gpu
def test_gpu_directions_overlap_on_two_streams() -> None:
    block = (8, 2, 16, 8, 128)  # 4 MiB bf16 blocks, as Qwen2.5-32B's are 64 layers of these
    mem = allocate_host_pool(block, torch.bfloat16, num_blocks=128, pin=True)
    try:
        dev = torch.zeros((128, *block), dtype=torch.bfloat16, device="cuda")
        plan = TransferPlan(1, swap_out=[(i, i) for i in range(0, 64)],
                            swap_in=[(i, i) for i in range(64, 128)])
        with DuplexEngine(dev, mem.tensor) as engine:
            engine.transfer(plan)
            t = engine.transfer(plan)
        assert t.overlap > 1.2  # both copy engines busy at once
    finally:
        mem.close()


@pytest.mark.gpu
def test_gpu_bench_transfer_against_the_link(tmp_path: Path) -> None:
    """The transfer engine's GPU goals, measured: block-first >= 90 % of one-way link bandwidth,
    duplex >= 1.7x one direction (printed; asserted loosely, a shared GPU is noisy)."""
    from superinfer.bench import transfer

    out = tmp_path / "t.json"
    args = argparse.Namespace(blocks=64, repeats=3, shapes="qwen2.5-32b", seed=0,
                              nt_threshold="default", copy_rows=False, json=str(out),
                              device="cuda")
    assert transfer.run(args) == 0
    qwen = json.loads(out.read_text())["shapes"]["qwen2.5-32b"]
    assert qwen["device"] == "cuda" and qwen["raw_d2h_gbps"] > 1 and qwen["raw_h2d_gbps"] > 1
    assert qwen["block_first_vs_raw"]["median"] > 0.5
    assert qwen["duplex_vs_block_first"]["median"] > 1.0
    goals = {g["goal"] for g in qwen["goals"]}
    assert {"block_first_d2h_share_of_link", "block_first_h2d_share_of_link"} <= goals
    assert qwen["block_first_d2h_gbps"] > 1 and qwen["block_first_h2d_gbps"] > 1
