"""kvmem: the KV-memory daemon's gRPC service (proto KVMem).

It holds memory and carries out orders, nothing more (DESIGN §6): the scheduler attaches
it to the worker's device pool and sends transfer batches, each checked against the
attached pool's id so that a batch planned for a previous worker is refused, not applied
to the wrong memory. Device->host and host->device copies of one batch run at the same
time in two threads (torch copies release the GIL): the CPU form of DuplexKV's two streams.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc
import structlog
import torch

from kvmem_svc.copy import copy_blocks
from kvmem_svc.pool import DeviceMapping, HostPool
from proto import kvmem_pb2, kvmem_pb2_grpc, worker_pb2
from superinfer.config import EngineConfig
from superinfer.daemon import Daemon, run_daemon

log = structlog.get_logger()


class KVMemService(kvmem_pb2_grpc.KVMemServicer):
    def __init__(self, host_blocks: int | None, host_memory_gib: float) -> None:
        self._sizing = EngineConfig(host_blocks=host_blocks, host_memory_gib=host_memory_gib)
        self.device: DeviceMapping | None = None
        self.host: HostPool | None = None
        self._lock = asyncio.Lock()  # one batch at a time: batches are ordered by fences
        self.transfers = 0
        self.blocks_d2h = 0
        self.blocks_h2d = 0
        self.busy_s = 0.0
        self.ordered_batches = 0  # batches that could not run duplex (see _transfer)

    # -- gRPC ------------------------------------------------------------------------------
    async def AttachPool(
        self, request: worker_pb2.KVPoolHandle, context: grpc.aio.ServicerContext
    ) -> kvmem_pb2.AttachReply:
        async with self._lock:
            try:
                host = await asyncio.to_thread(self._attach, request)
            except (ValueError, OSError, RuntimeError, MemoryError) as e:
                log.error("attach_failed", pool_id=request.pool_id, error=str(e))
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot map pool: {e}")
        return kvmem_pb2.AttachReply(host_blocks=host.num_blocks, pool_id=request.pool_id)

    async def Transfer(
        self, request: kvmem_pb2.TransferRequest, context: grpc.aio.ServicerContext
    ) -> kvmem_pb2.TransferReply:
        try:
            async with self._lock:
                return await self._transfer(request)
        except Refusal as r:
            await context.abort(r.code, r.message)
            raise  # not reached: abort raises

    async def _transfer(self, request: kvmem_pb2.TransferRequest) -> kvmem_pb2.TransferReply:
        dev, host = self.device, self.host
        if dev is None or host is None or request.pool_id != dev.pool_id:
            attached = dev.pool_id if dev else "none"
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"transfer for pool {request.pool_id!r} but the attached pool is {attached!r}",
            )
        n_dev, n_host = dev.num_blocks, host.num_blocks
        d2h = (_pairs(request.swap_out, n_dev, n_host, "swap_out")
               + _pairs(request.eager, n_dev, n_host, "eager"))
        h2d = _pairs(request.swap_in, n_host, n_dev, "swap_in")
        if {h for _, h in d2h} & {h for h, _ in h2d}:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          "a host block is both written (D2H) and read (H2D) by one batch")
        t0 = time.perf_counter()
        if {d for d, _ in d2h} & {d for _, d in h2d}:
            # A device block this batch copies out is also a swap-in target (the block
            # manager may reuse a block freed by this iteration's rotate-out): the D2H copy
            # must read it before the H2D copy overwrites it, so no duplex for this batch.
            self.ordered_batches += 1
            log.warning("ordered_transfer", fence=request.fence,
                        reason="device block both D2H source and H2D target")
            d2h_s = await asyncio.to_thread(_timed_copy, dev.tensor, host.tensor, d2h)
            h2d_s = await asyncio.to_thread(_timed_copy, host.tensor, dev.tensor, h2d)
        else:
            d2h_s, h2d_s = await asyncio.gather(
                asyncio.to_thread(_timed_copy, dev.tensor, host.tensor, d2h),
                asyncio.to_thread(_timed_copy, host.tensor, dev.tensor, h2d),
            )
        total = time.perf_counter() - t0
        self.transfers += 1
        self.blocks_d2h += len(d2h)
        self.blocks_h2d += len(h2d)
        self.busy_s += total
        log.debug("transfer", fence=request.fence, d2h=len(d2h), h2d=len(h2d), total_s=total)
        return kvmem_pb2.TransferReply(
            fence=request.fence,
            d2h_s=d2h_s,
            h2d_s=h2d_s,
            total_s=total,
            bytes_d2h=len(d2h) * dev.block_bytes,
            bytes_h2d=len(h2d) * dev.block_bytes,
        )

    async def GetStats(
        self, request: kvmem_pb2.KVMemStatsRequest, context: grpc.aio.ServicerContext
    ) -> kvmem_pb2.KVMemStats:
        return kvmem_pb2.KVMemStats(
            host_blocks=self.host.num_blocks if self.host else 0,
            pool_id=self.device.pool_id if self.device else "",
            transfers=self.transfers,
            blocks_d2h=self.blocks_d2h,
            blocks_h2d=self.blocks_h2d,
            busy_s=self.busy_s,
            mode=f"{self.device.kind}+duplex-threads" if self.device else "detached",
        )

    # -- pools ---------------------------------------------------------------------------
    def _attach(self, handle: worker_pb2.KVPoolHandle) -> HostPool:
        """Map the worker's pool, replacing any earlier mapping.

        Host contents survive a re-attach when the block shape is unchanged: after a
        worker restart, synced blocks' host copies are still the request's KV and the
        scheduler may swap them in (DESIGN §6). A different block shape means a different
        model or layout, and a new host pool.
        """
        new = DeviceMapping(handle)
        old, self.device = self.device, new
        if old is not None:
            old.close()
        bb = new.block_bytes
        if self.host is None or not self.host.fits(new.block_shape, new.dtype):
            _, n = self._sizing.blocks_for(bb)
            self.host = None  # drop the old region before mapping a new one
            t0 = time.perf_counter()
            self.host = HostPool.allocate(n, new.block_shape, new.dtype)
            log.info("host_pool", host_blocks=n, block_bytes=bb, gib=round(n * bb / 2**30, 3),
                     alloc_s=round(time.perf_counter() - t0, 3))
        log.info("attached", pool_id=new.pool_id, kind=new.kind, device_blocks=new.num_blocks,
                 replaced=old.pool_id if old else None)
        return self.host

    async def close(self) -> None:
        async with self._lock:
            if self.device is not None:
                self.device.close()
                self.device = None
            self.host = None


class Refusal(Exception):
    """An order kvmem will not carry out; becomes the gRPC status `code`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _pairs(
    bp: kvmem_pb2.BlockPairs, n_src: int, n_dst: int, what: str
) -> list[tuple[int, int]]:
    """Packed (src, dst) pairs, each naming an existing block of its tier.

    A bad index is a bug upstream; refusing it keeps it from becoming a crash here.
    """
    if len(bp.src) != len(bp.dst):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: src and dst differ in length")
    pairs = list(zip(bp.src, bp.dst))
    for src, dst in pairs:
        if not (0 <= src < n_src and 0 <= dst < n_dst):
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}: block pair {src} -> {dst} out of range ({n_src} source, "
                f"{n_dst} destination blocks)",
            )
    return pairs


def _timed_copy(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> float:
    t0 = time.perf_counter()
    if pairs:
        copy_blocks(src, dst, pairs)
    return time.perf_counter() - t0


class KVMemDaemon(Daemon):
    name = "kvmem"

    def __init__(self, args: argparse.Namespace) -> None:
        self.service = KVMemService(args.host_blocks, args.host_memory_gib)

    def register(self, server: grpc.aio.Server) -> None:
        kvmem_pb2_grpc.add_KVMemServicer_to_server(self.service, server)

    async def start(self) -> None:
        log.info("waiting_for_attach")  # the host pool is sized at the first AttachPool

    async def stop(self) -> None:
        await self.service.close()


def main(args: argparse.Namespace) -> int:
    return run_daemon(KVMemDaemon(args), args)
