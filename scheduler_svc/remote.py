"""The scheduler's gRPC clients for the worker and kvmem: its executor and transfer engine.

The async counterparts of `interfaces.Executor` / `interfaces.TransferEngine`: the same
orders, sent over the wire. Each call names the device pool it was planned for, so a
restarted worker or kvmem refuses it (FAILED_PRECONDITION) instead of computing on, or
copying into, memory that no longer holds what the scheduler thinks it holds.

Every call carries a deadline: `rpc_timeout_s` for a batch (a hung peer then fails the
iteration and the loop recovers, instead of waiting forever), short ones for the rest.
Channels retry a restarted peer within a second (gRPC's default backoff grows to 2 min).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan
from common.daemon import CHANNEL_OPTIONS
from common.wire import chunk_to_proto, plan_to_proto, result_from_proto
from proto import kvmem_pb2, kvmem_pb2_grpc, scheduler_pb2, worker_pb2, worker_pb2_grpc

RPC_TIMEOUT_S = 120.0  # default deadline of one batch (Execute, Transfer)
ATTACH_TIMEOUT_S = 600.0  # allocating and pre-faulting a multi-GiB host pool takes a while
INFO_TIMEOUT_S = 10.0
PEER_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


async def wait_serving(channel: grpc.aio.Channel, what: str, timeout_s: float) -> None:
    """Wait until the peer's health service says SERVING (it may still be loading a model)."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0,
                                     wait_for_ready=True)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as e:
            last = e.code().name
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{what} not SERVING after {timeout_s:.0f} s (last: {last})")


class RemoteWorker:
    def __init__(self, addr: str, rpc_timeout_s: float = RPC_TIMEOUT_S) -> None:
        self.addr = addr
        self.rpc_timeout_s = rpc_timeout_s
        self.channel = grpc.aio.insecure_channel(addr, options=PEER_CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    async def wait_serving(self, timeout_s: float) -> None:
        await wait_serving(self.channel, f"worker at {self.addr}", timeout_s)

    async def model_info(self) -> scheduler_pb2.ModelInfo:
        return await self.stub.GetModelInfo(scheduler_pb2.ModelInfoRequest(),
                                            timeout=INFO_TIMEOUT_S)

    async def kv_pool(self) -> worker_pb2.KVPoolHandle:
        return await self.stub.GetKVPool(worker_pb2.KVPoolRequest(), timeout=INFO_TIMEOUT_S)

    async def execute(
        self, iteration: int, chunks: list[ScheduledChunk], pool_id: str, after: int = 0,
        released: Sequence[str] = (),
    ) -> ExecuteResult:
        request = worker_pb2.ExecuteRequest(
            iteration=iteration, chunks=[chunk_to_proto(c) for c in chunks], pool_id=pool_id,
            after_iteration=after, released=released,
        )
        return result_from_proto(await self.stub.Execute(request, timeout=self.rpc_timeout_s))

    async def close(self) -> None:
        await self.channel.close()


class RemoteKVMem:
    def __init__(self, addr: str, rpc_timeout_s: float = RPC_TIMEOUT_S) -> None:
        self.addr = addr
        self.rpc_timeout_s = rpc_timeout_s
        self.channel = grpc.aio.insecure_channel(addr, options=PEER_CHANNEL_OPTIONS)
        self.stub = kvmem_pb2_grpc.KVMemStub(self.channel)

    async def wait_serving(self, timeout_s: float) -> None:
        await wait_serving(self.channel, f"kvmem at {self.addr}", timeout_s)

    async def attach(self, handle: worker_pb2.KVPoolHandle) -> kvmem_pb2.AttachReply:
        return await self.stub.AttachPool(handle, timeout=ATTACH_TIMEOUT_S)

    async def transfer(self, plan: TransferPlan, pool_id: str) -> kvmem_pb2.TransferReply:
        return await self.stub.Transfer(plan_to_proto(plan, pool_id), timeout=self.rpc_timeout_s)

    async def stats(self) -> kvmem_pb2.KVMemStats:
        return await self.stub.GetStats(kvmem_pb2.KVMemStatsRequest(), timeout=INFO_TIMEOUT_S)

    async def close(self) -> None:
        await self.channel.close()
