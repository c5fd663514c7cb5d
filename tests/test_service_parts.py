"""The service pieces without a model: shared memory, kvmem over real gRPC, the wire
format, the scheduler's iteration loop against the KV-checking fakes, flags, supervision.

Fast (no model load); the processes with the real model are in test_services.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import stat
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
import torch

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan
from common.daemon import CHANNEL_OPTIONS, SERVER_OPTIONS, PidFile
from common.pool_handle import decode_cuda_ipc, encode_cuda_ipc
from common.shm import SharedTensor
from common.wire import chunk_from_proto, chunk_to_proto, plan_to_proto
from kvmem_svc.service import KVMemService
from proto import kvmem_pb2, kvmem_pb2_grpc, worker_pb2
from scheduler_svc.loop import EventQueue, ServingLoop, StreamEvent
from scheduler_svc.policy import make_policy
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from superinfer import services_cli
from superinfer.supervisor import ServiceFailed, ServiceSpec, Supervisor
from tests.kvcheck import CheckingExecutor, KVStore, next_token
from worker.batches import BatchRunner
from worker.kv_pool import DevicePool

T = TypeVar("T")
SHAPE = (8, 2, 2, 4, 1, 8)  # [blocks, layers, K/V, block_size, kv_heads, head_dim]


def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


# -- shared memory ------------------------------------------------------------------------------
def test_shared_tensor_is_private_shared_and_unlinked_by_its_owner() -> None:
    owner = SharedTensor.create((4, 16), torch.float32)
    path = Path("/dev/shm") / owner.name
    try:
        assert owner.name.startswith("si-kv-") and len(owner.name) == len("si-kv-") + 16
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        peer = SharedTensor.attach(owner.name, (4, 16), torch.float32)
        owner.tensor[2] = 7.0
        assert torch.equal(peer.tensor[2], torch.full((16,), 7.0))
        peer.close()  # a peer unmaps but never unlinks
        assert path.exists()
        with pytest.raises(ValueError, match="need"):
            SharedTensor.attach(owner.name, (400, 16), torch.float32)
    finally:
        owner.close()
    assert not path.exists()
    owner.close()  # twice is fine


def test_cuda_ipc_handles_travel_as_json_not_pickle() -> None:
    # The tuple UntypedStorage._share_cuda_() returns: ints, bytes handles, a bool.
    fields = (0, b"\x00\xffhandle", 4096, 0, b"ref", 16, b"", True)
    blob = encode_cuda_ipc(fields)
    assert decode_cuda_ipc(blob) == fields and blob.startswith(b"[")


# -- kvmem over gRPC ------------------------------------------------------------------------------
async def _with_kvmem(
    body: Callable[[kvmem_pb2_grpc.KVMemStub, KVMemService], Awaitable[None]], host_blocks: int
) -> None:
    service = KVMemService(host_blocks=host_blocks, host_memory_gib=0.0)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    kvmem_pb2_grpc.add_KVMemServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            await body(kvmem_pb2_grpc.KVMemStub(ch), service)
    finally:
        await server.stop(None)
        await service.close()


def _plan(fence: int, out: list[tuple[int, int]] = [], into: list[tuple[int, int]] = [],  # noqa: B006
          eager: list[tuple[int, int]] = []) -> TransferPlan:  # noqa: B006
    return TransferPlan(fence=fence, swap_out=list(out), swap_in=list(into), eager=list(eager))


def test_kvmem_runs_each_plan_on_every_tensor_parallel_rank() -> None:
    """Two ranks' pool shards in one handle (worker/tp.py): one host pool per rank, one
    plan moves the same block ids on both, and --host-memory-gib is the ranks' total."""
    shards = [DevicePool.create(SHAPE, torch.float32) for _ in range(2)]
    for p in shards:
        p.tensor.copy_(torch.randn(SHAPE))
    original = [p.tensor.clone() for p in shards]
    handle = shards[0].handle()
    handle.shard_shm_names.extend([p.handle().shm_name for p in shards])

    async def body(stub: kvmem_pb2_grpc.KVMemStub, service: KVMemService) -> None:
        reply = await stub.AttachPool(handle)
        assert reply.host_blocks == 6 and len(service.hosts) == 2
        r = await stub.Transfer(plan_to_proto(_plan(1, out=[(1, 0), (2, 1)], eager=[(5, 4)]),
                                              handle.pool_id))
        block = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4
        assert r.bytes_d2h == 3 * 2 * block  # 3 blocks on each of 2 ranks
        for rank in range(2):
            for d, h in [(1, 0), (2, 1), (5, 4)]:
                assert torch.equal(service.hosts[rank].tensor[h], original[rank][d])
            shards[rank].tensor[1:3].zero_()
        await stub.Transfer(plan_to_proto(_plan(2, into=[(0, 6), (1, 7)]), handle.pool_id))
        for rank in range(2):  # each rank got its own KV back, not rank 0's
            assert torch.equal(shards[rank].tensor[6], original[rank][1])
            assert torch.equal(shards[rank].tensor[7], original[rank][2])
        stats = await stub.GetStats(kvmem_pb2.KVMemStatsRequest())
        assert stats.mode.endswith("x2 ranks") and (stats.blocks_d2h, stats.blocks_h2d) == (3, 2)

    try:
        asyncio.run(_with_kvmem(body, host_blocks=6))
    finally:
        for p in shards:
            p.close()

    # Sized by memory: the budget holds 8 blocks of 2 ranks, so 4 per rank's host pool.
    service = KVMemService(host_blocks=None,
                           host_memory_gib=8 * SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[5] * 4
                           / 2**30)
    shards = [DevicePool.create(SHAPE, torch.float32) for _ in range(2)]
    handle = shards[0].handle()
    handle.shard_shm_names.extend([p.handle().shm_name for p in shards])
    try:
        assert service._attach(handle).num_blocks == 4
    finally:
        asyncio.run(service.close())
        for p in shards:
            p.close()


def test_kvmem_moves_blocks_both_ways_and_refuses_stale_orders() -> None:
    pool = DevicePool.create(SHAPE, torch.float32)
    dev = pool.tensor
    dev.copy_(torch.randn(SHAPE))
    original = dev.clone()

    async def body(stub: kvmem_pb2_grpc.KVMemStub, service: KVMemService) -> None:
        reply = await stub.AttachPool(pool.handle())
        assert reply.host_blocks == 6 and reply.pool_id == pool.pool_id
        # Blocks 1, 2 (a run) and 5 out to host 0, 1, 4; eager copy of block 3 to host 3.
        r = await stub.Transfer(plan_to_proto(_plan(1, out=[(1, 0), (2, 1), (5, 4)],
                                                    eager=[(3, 3)]), pool.pool_id))
        assert r.fence == 1 and r.bytes_d2h == 4 * dev[0].numel() * 4 and r.bytes_h2d == 0
        host = service.host
        assert host is not None
        for d, h in [(1, 0), (2, 1), (5, 4), (3, 3)]:
            assert torch.equal(host.tensor[h], original[d])
        dev[1:3].zero_()
        # Duplex: host 0, 1 back into device 6, 7 while block 0 goes out to host 5.
        await stub.Transfer(plan_to_proto(_plan(2, out=[(0, 5)], into=[(0, 6), (1, 7)]),
                                          pool.pool_id))
        assert torch.equal(dev[6], original[1]) and torch.equal(dev[7], original[2])
        assert torch.equal(host.tensor[5], original[0])
        # One device block as D2H source and H2D target in the same batch: the copy out
        # must read it before the copy in overwrites it.
        before = dev[4].clone()
        await stub.Transfer(plan_to_proto(_plan(3, out=[(4, 2)], into=[(3, 4)]), pool.pool_id))
        assert torch.equal(host.tensor[2], before) and torch.equal(dev[4], original[3])
        assert service.ordered_batches == 1

        for bad, code in [
            (plan_to_proto(_plan(4, out=[(0, 0)]), "another-pool"),
             grpc.StatusCode.FAILED_PRECONDITION),
            (plan_to_proto(_plan(5, out=[(8, 0)]), pool.pool_id), grpc.StatusCode.INVALID_ARGUMENT),
            (plan_to_proto(_plan(6, into=[(6, 0)]), pool.pool_id),
             grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Transfer(bad)
            assert e.value.code() is code
        stats = await stub.GetStats(kvmem_pb2.KVMemStatsRequest())
        assert (stats.transfers, stats.blocks_d2h, stats.blocks_h2d) == (3, 6, 3)
        assert stats.pool_id == pool.pool_id and stats.mode == "shm+duplex: cpu, 2 threads, memmove"

        # A restarted worker: new pool, same block shape. Orders for the old pool are
        # refused; host copies (the KV of rotary requests) survive the re-attach.
        pool2 = DevicePool.create(SHAPE, torch.float32)
        try:
            await stub.AttachPool(pool2.handle())
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Transfer(plan_to_proto(_plan(7, out=[(0, 0)]), pool.pool_id))
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            await stub.Transfer(plan_to_proto(_plan(8, into=[(4, 0)]), pool2.pool_id))
            assert torch.equal(pool2.tensor[0], original[5])
        finally:
            pool2.close()

    try:
        run(lambda: _with_kvmem(body, host_blocks=6))
    finally:
        pool.close()


def test_kvmem_refuses_a_pool_it_cannot_map() -> None:
    async def body(stub: kvmem_pb2_grpc.KVMemStub, service: KVMemService) -> None:
        handle = worker_pb2.KVPoolHandle(pool_id="x", kind="shm", shm_name="si-kv-missing",
                                         shape=list(SHAPE), dtype="float32")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.AttachPool(handle)
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as e:  # nothing attached: no transfer
            await stub.Transfer(plan_to_proto(_plan(1, out=[(0, 0)]), "x"))
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION

    run(lambda: _with_kvmem(body, host_blocks=4))


# -- wire format -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [None, 0, 2**40])
def test_chunks_survive_the_wire(seed: int | None) -> None:
    c = ScheduledChunk("r1", [5, 6, 7], 32, [3, 9, 1], True, 0.5, 0.75, 40, seed, 7)
    assert chunk_from_proto(chunk_to_proto(c)) == c


def test_transfer_plans_pack_source_first() -> None:
    m = plan_to_proto(_plan(3, out=[(1, 10)], into=[(20, 2)], eager=[(4, 40)]), "p")
    assert (list(m.swap_out.src), list(m.swap_out.dst)) == ([1], [10])  # device -> host
    assert (list(m.swap_in.src), list(m.swap_in.dst)) == ([20], [2])  # host -> device
    assert (list(m.eager.src), list(m.eager.dst)) == ([4], [40])
    assert m.fence == 3 and m.pool_id == "p"


# -- the iteration loop, against the KV-checking fakes ----------------------------------------------
class FakeWorker:
    """CheckingExecutor behind the RemoteWorker interface, run by the real BatchRunner (in
    order, placeholders filled in); can be told to fail, or to restart: a new pool id and
    every device block overwritten (the old KV is gone)."""

    def __init__(self, store: KVStore) -> None:
        self.truth: dict[str, list[int]] = {}  # request id -> prompt
        self.store = store
        self.inner = CheckingExecutor(store, self.truth)
        self.fail_next = False
        self.pool_id = "pool-1"
        self.batches = BatchRunner(self._execute)

    def restart(self) -> None:
        self.pool_id = "pool-2"
        self.batches = BatchRunner(self._execute)  # a new process: no batch ran yet
        for block in self.store.device:
            block[:] = [-7] * len(block)

    async def wait_serving(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    def _execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        return self.inner.execute(chunks)

    async def execute(self, iteration: int, chunks: list[ScheduledChunk],
                      pool_id: str, after: int = 0, released: Sequence[str] = ()) -> ExecuteResult:
        await asyncio.sleep(0)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("worker exploded")
        if pool_id != self.pool_id:  # as the real worker: FAILED_PRECONDITION
            raise RuntimeError(f"batch for pool {pool_id}, this worker's is {self.pool_id}")
        return await self.batches.run(iteration, after, chunks)

    async def kv_pool(self) -> worker_pb2.KVPoolHandle:
        await self.batches.barrier()  # as the real worker: after any forward in flight
        return worker_pb2.KVPoolHandle(pool_id=self.pool_id, shape=[16, 1, 2, 4, 1, 1])


class FakeKVMem:
    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.host_pool_id = ""
        self.attached = True

    def restart(self) -> None:
        """A new process: a new, empty host pool, attached to nothing yet."""
        self.host_pool_id, self.attached = "host-2", False
        for block in self.store.host:
            block[:] = [-7] * len(block)

    async def wait_serving(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    async def transfer(self, plan: TransferPlan, pool_id: str) -> kvmem_pb2.TransferReply:
        await asyncio.sleep(0)
        if not self.attached:  # as the real kvmem: FAILED_PRECONDITION
            raise RuntimeError("no pool attached")
        self.store.transfer(plan)
        return kvmem_pb2.TransferReply(fence=plan.fence)

    async def attach(self, handle: worker_pb2.KVPoolHandle) -> kvmem_pb2.AttachReply:
        self.attached = True
        return kvmem_pb2.AttachReply(host_blocks=64, pool_id=handle.pool_id,
                                     host_pool_id=self.host_pool_id)


def _loop(device_blocks: int = 16, pipelined: bool = False) -> tuple[ServingLoop, FakeWorker]:
    sched = Scheduler(
        SchedulerConfig(num_device_blocks=device_blocks, num_host_blocks=64, block_size=4,
                        max_batched_tokens=32, eager_budget_blocks=4, pipelined=pipelined),
        make_policy("lvf"),
    )
    store = KVStore(device_blocks, 64, 4)
    worker = FakeWorker(store)
    return ServingLoop(sched, worker, FakeKVMem(store), "pool-1"), worker  # type: ignore[arg-type]


def _submit(loop: ServingLoop, worker: FakeWorker, rid: str, prompt: list[int],
            n: int) -> asyncio.Queue[StreamEvent]:
    worker.truth[rid] = list(prompt)
    queue = EventQueue()
    loop.submit(Request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True),
                        arrival_time=loop.scheduler.clock(), slo=SLO(0.05, 0.01)), queue)
    return queue


async def _settled(loop: ServingLoop) -> None:
    """Until no batch is in flight any more."""
    while loop.scheduler.in_flight:
        await asyncio.sleep(0.001)


async def _drain(q: asyncio.Queue[StreamEvent]) -> list[StreamEvent]:
    events = [await q.get()]
    while not events[-1].finish_reason:
        events.append(await q.get())
    return events


def _expected(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_loop_streams_every_token_through_rotation_and_frees_all_blocks(pipelined: bool) -> None:
    async def body() -> None:
        loop, worker = _loop(device_blocks=16, pipelined=pipelined)
        task = asyncio.create_task(loop.run())
        prompts = [[i, i + 1, i + 2, 3 * i] for i in range(12)]
        queues = [_submit(loop, worker, f"r{i}", p, 20) for i, p in enumerate(prompts)]
        results = await asyncio.wait_for(asyncio.gather(*map(_drain, queues)), 60)
        for p, events in zip(prompts, results):
            assert [t for ev in events for t in ev.token_ids] == _expected(p, 20)
            assert events[-1].finish_reason == "length" and events[-1].summary is not None
            assert [ev.output_tokens for ev in events] == list(range(1, 21))
        s = loop.scheduler
        assert s.stats.rotations > 0  # 12 x 6 blocks against 16: the loop had to rotate
        assert s.bm.num_free_device == 16 and s.bm.num_free_host == 64
        assert not loop.streams
        task.cancel()

    run(body)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_loop_abort_stop_and_dropped_streams_end_cleanly(pipelined: bool) -> None:
    async def body() -> None:
        loop, worker = _loop(pipelined=pipelined)
        task = asyncio.create_task(loop.run())
        qa = _submit(loop, worker, "a", [1, 2, 3], 1000)
        qb = _submit(loop, worker, "b", [4, 5, 6], 1000)
        _submit(loop, worker, "c", [7, 8, 9], 1000)
        await qa.get()
        await qb.get()
        assert loop.finish("a", "stop") and not loop.finish("a", "stop")
        assert loop.finish("b", "abort")
        loop.drop("c")  # the client of c went away
        ea, eb = await _drain(qa), await _drain(qb)
        assert ea[-1].finish_reason == "stop" and eb[-1].finish_reason == "abort"
        assert not loop.scheduler.has_unfinished() and not loop.streams
        # Free for compute at once; for swap-ins once the batch in flight is done.
        assert loop.scheduler.bm.num_free_for_compute == 16
        await asyncio.wait_for(_settled(loop), 10)
        assert loop.scheduler.bm.num_free_device == 16
        assert loop.scheduler.stats.aborted == 2
        task.cancel()

    run(body)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_loop_fails_in_flight_requests_on_a_peer_error_and_recovers(pipelined: bool) -> None:
    """A batch fails with the same pools (say, a deadline): the iteration is re-run."""
    async def body() -> None:
        loop, worker = _loop(pipelined=pipelined)
        task = asyncio.create_task(loop.run())
        q = _submit(loop, worker, "a", [1, 2, 3], 40)
        first = await q.get()
        worker.fail_next = True
        events = [first, *await asyncio.wait_for(_drain(q), 10)]
        assert [t for ev in events for t in ev.token_ids] == _expected([1, 2, 3], 40)
        assert events[-1].finish_reason == "length"
        assert loop.stats.backend_errors == 1 and loop.stats.recoveries == 1
        assert loop.stats.device_losses == 0 and loop.pool_id == "pool-1"
        assert loop.scheduler.bm.num_free_device == 16
        task.cancel()

    run(body)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_loop_resumes_every_request_after_a_worker_and_a_kvmem_restart(pipelined: bool) -> None:
    async def body() -> None:
        loop, worker = _loop(device_blocks=16, pipelined=pipelined)
        kvmem: FakeKVMem = loop.kvmem  # type: ignore[assignment]
        task = asyncio.create_task(loop.run())
        prompts = [[i, i + 1, i + 2, 3 * i] for i in range(8)]
        queues = [_submit(loop, worker, f"r{i}", p, 30) for i, p in enumerate(prompts)]
        got: list[list[int]] = [[] for _ in prompts]

        async def collect(i: int) -> None:
            while True:
                ev = await queues[i].get()
                assert ev.error is None
                got[i] += ev.token_ids
                if ev.finish_reason:
                    return

        collectors = asyncio.gather(*(collect(i) for i in range(8)))

        async def until_all_have(n: int) -> None:
            while min(map(len, got)) < n:
                if collectors.done():
                    collectors.result()  # raises what went wrong
                await asyncio.sleep(0)

        await asyncio.wait_for(until_all_have(8), 30)
        worker.restart()  # its pool is gone: every request resumes from host copies
        await asyncio.wait_for(until_all_have(16), 30)
        kvmem.restart()  # every host copy is gone: rotary requests recompute
        await asyncio.wait_for(collectors, 60)
        assert got == [_expected(p, 30) for p in prompts]
        st = loop.stats
        assert (st.device_losses, st.host_losses, st.recoveries) == (1, 1, 2)
        assert st.resumed_swap_in > 0  # eager host copies saved recomputing
        s = loop.scheduler
        assert s.bm.num_free_device == 16 and s.bm.num_free_host == 64
        assert loop.pool_id == "pool-2" and loop.host_pool_id == "host-2"
        task.cancel()

    run(body)


class _FlakyKVMem(FakeKVMem):
    """Every `every`-th copy fails (three times at most, so that the loop does not give up)
    without touching the pools, as a refused RPC would."""

    def __init__(self, store: KVStore, every: int) -> None:
        super().__init__(store)
        self.every, self.calls, self.failed = every, 0, 0

    async def transfer(self, plan: TransferPlan, pool_id: str) -> kvmem_pb2.TransferReply:
        self.calls += 1
        if self.calls % self.every == 0 and self.failed < 3:
            await asyncio.sleep(0)
            self.failed += 1
            raise RuntimeError("copy refused")
        return await super().transfer(plan, pool_id)


@pytest.mark.parametrize("every", [2, 3, 4, 5, 7])
def test_tokens_that_landed_before_a_failed_copy_reach_their_streams(every: int) -> None:
    """A pipelined step can take batch t's tokens and then fail on t+1's copies: the
    requests hold those tokens, so the streams must get them before recovery."""
    async def body() -> None:
        loop, worker = _loop(pipelined=True)
        loop.kvmem = kvmem = _FlakyKVMem(worker.store, every)
        task = asyncio.create_task(loop.run())
        prompts = [[i, i + 1, i + 2, 3 * i] for i in range(8)]
        queues = [_submit(loop, worker, f"r{i}", p, 30) for i, p in enumerate(prompts)]
        got = [[t for ev in await asyncio.wait_for(_drain(q), 60) for t in ev.token_ids]
               for q in queues]
        assert got == [_expected(p, 30) for p in prompts]
        assert kvmem.failed > 0 and loop.stats.recoveries > 0
        task.cancel()

    run(body)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_loop_gives_up_on_a_batch_that_always_fails_and_drains_on_shutdown(pipelined: bool) -> None:
    async def body() -> None:
        loop, worker = _loop(pipelined=pipelined)
        task = asyncio.create_task(loop.run())

        async def always_fail(*args: object) -> ExecuteResult:
            raise RuntimeError("bad batch")

        good = worker.execute
        worker.execute = always_fail  # type: ignore[method-assign,assignment]
        q = _submit(loop, worker, "a", [1, 2, 3], 5)
        [ev] = await asyncio.wait_for(_drain(q), 10)
        assert ev.finish_reason == "error" and ev.error is not None
        assert "failed 5 times in a row" in ev.error and "bad batch" in ev.error
        assert loop.scheduler.bm.num_free_device == 16
        worker.execute = good  # type: ignore[method-assign]
        q = _submit(loop, worker, "b", [1, 2, 3], 10_000)
        await q.get()
        await loop.drain(0.0)
        events = await asyncio.wait_for(_drain(q), 10)
        assert events[-1].error is not None and "shutting down" in events[-1].error
        assert loop.draining and not loop.scheduler.has_unfinished()
        assert loop.scheduler.bm.num_free_device == 16
        task.cancel()

    run(body)


# -- flags and processes -----------------------------------------------------------------------------
def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    services_cli._add_serve(p)
    return p.parse_args(list(argv))


def test_each_engine_flag_goes_to_the_service_that_owns_it() -> None:
    args = _serve_args("--device-blocks", "24", "--host-blocks", "99", "--policy", "fcfs",
                       "--block-size", "8", "--worker-port", "6001", "--run-dir", "/tmp/x")
    specs = {s.name: s.argv for s in services_cli.service_specs(args)}
    worker, kvmem, sched = specs["worker"], specs["kvmem"], specs["scheduler"]

    def flag(argv: list[str], name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    assert flag(worker, "--device-blocks") == "24" and flag(worker, "--block-size") == "8"
    assert flag(worker, "--port") == "6001" and flag(worker, "--host") == "127.0.0.1"
    assert flag(kvmem, "--host-blocks") == "99" and "--device-blocks" not in kvmem
    assert flag(sched, "--policy") == "fcfs" and flag(sched, "--worker-addr") == "127.0.0.1:6001"
    for argv in (worker, kvmem):
        assert "--policy" not in argv
    for name in ("--device-blocks", "--block-size", "--host-blocks", "--dtype", "--model"):
        assert name not in sched
    assert all(flag(a, "--run-dir") == "/tmp/x" for a in (worker, kvmem, sched))
    if "gateway" in specs:
        assert flag(specs["gateway"], "--scheduler-addr") == "127.0.0.1:50051"
        assert flag(specs["gateway"], "--port") == "8000"


@pytest.mark.parametrize("argv", [(), ("--no-pipeline", "--no-enable-prefix-caching"),
                                  ("--pipeline", "--no-enable-prefix-caching")])
def test_on_off_flags_reach_the_scheduler_as_given(argv: tuple[str, ...]) -> None:
    """`--pipeline` and `--enable-prefix-caching` have --no- spellings: the scheduler must
    get the value serve was given (it once got `--no-pipeline` for the default)."""
    args = _serve_args(*argv)
    sched = {s.name: s.argv for s in services_cli.service_specs(args)}["scheduler"]
    p = argparse.ArgumentParser()
    services_cli._add_scheduler(p)
    got = p.parse_args(sched[sched.index("scheduler") + 1:])
    assert (got.pipeline, got.enable_prefix_caching) == (args.pipeline,
                                                         args.enable_prefix_caching)


def test_pid_file_refuses_a_second_live_copy(tmp_path: Path) -> None:
    path = tmp_path / "worker.pid"
    path.write_text("1\n")  # pid 1 is alive: another copy "runs"
    with pytest.raises(RuntimeError, match="running process 1"):
        PidFile(path).acquire()
    path.write_text("999999999\n")  # stale: taken over
    pid = PidFile(path)
    pid.acquire()
    assert path.read_text().strip() == str(os.getpid())
    pid.release()
    assert not path.exists()


def test_supervisor_reports_a_child_that_dies_while_starting(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, stop_timeout_s=5)
    spec = ServiceSpec("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                       (lambda: False, lambda: None))
    with pytest.raises(ServiceFailed) as e:
        sup.start(spec, timeout_s=30)
    assert "exited with code 3" in str(e.value) and "no model here" in e.value.tail
    sup.stop_all()
