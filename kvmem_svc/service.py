"""kvmem: the KV-memory daemon's gRPC service (proto KVMem).

It holds memory and carries out orders, nothing more (DESIGN §6): the scheduler attaches
it to the worker's device pool and sends transfer batches, each checked against the
attached pool's id so that a batch planned for a previous worker is refused, not applied
to the wrong memory. Device->host and host->device copies of one batch run at the same
time in two threads (torch copies release the GIL): the CPU form of DuplexKV's two streams.
"""

from __future__ import annotations

import argparse
import uuid

import grpc
import structlog

from common.config import EngineConfig
from common.contracts import TransferPlan
from common.daemon import Daemon, run_daemon
from common.lane import ThreadLane
from kvmem_svc.duplex import Mode, TransferConflict, TransferError
from kvmem_svc.hostmem import HostMemory, allocate_host_pool
from kvmem_svc.pool import DeviceMapping
from kvmem_svc.ranks import RankedEngine
from kvmem_svc.tunables import nt_threshold_in_effect, reexec_with_copy_tunables
from proto import kvmem_pb2, kvmem_pb2_grpc, worker_pb2

log = structlog.get_logger()


class KVMemService(kvmem_pb2_grpc.KVMemServicer):
    def __init__(self, host_blocks: int | None, host_memory_gib: float,
                 transfer_mode: str = "duplex", numa_node: str | int = "auto") -> None:
        self._sizing = EngineConfig(host_blocks=host_blocks, host_memory_gib=host_memory_gib)
        self._mode = Mode(transfer_mode)
        self._numa = numa_node
        self.device: DeviceMapping | None = None
        self.host: HostMemory | None = None  # rank 0's host pool
        self.hosts: list[HostMemory] = []  # one per tensor-parallel rank (kvmem_svc/ranks.py)
        self.engine: RankedEngine | None = None
        self.host_pool_id = ""  # new with each host pool: a new one means copies are gone
        # Attaching, copies and closing run on one thread, in arrival order; a cancelled
        # RPC stops waiting but never lets the next job run beside its copies.
        self._lane = ThreadLane("kv-copy")
        self.transfers = 0
        self.blocks_d2h = 0
        self.blocks_h2d = 0
        self.busy_s = 0.0
        self.ordered_batches = 0  # batches that could not run duplex (see _transfer)

    # -- gRPC ------------------------------------------------------------------------------
    async def AttachPool(
        self, request: worker_pb2.KVPoolHandle, context: grpc.aio.ServicerContext
    ) -> kvmem_pb2.AttachReply:
        try:
            host = await self._lane.run(self._attach, request)
        except (ValueError, OSError, RuntimeError, MemoryError) as e:
            log.error("attach_failed", pool_id=request.pool_id, error=str(e))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot map pool: {e}")
        return kvmem_pb2.AttachReply(host_blocks=host.num_blocks, pool_id=request.pool_id,
                                     host_pool_id=self.host_pool_id)

    async def Transfer(
        self, request: kvmem_pb2.TransferRequest, context: grpc.aio.ServicerContext
    ) -> kvmem_pb2.TransferReply:
        try:
            return await self._lane.run(self._transfer, request)
        except Refusal as r:
            await context.abort(r.code, r.message)
            raise  # not reached: abort raises

    def _transfer(self, request: kvmem_pb2.TransferRequest) -> kvmem_pb2.TransferReply:
        """On the lane's thread: check the plan against the attached pool, copy."""
        dev, host = self.device, self.host
        if dev is None or host is None or request.pool_id != dev.pool_id:
            attached = dev.pool_id if dev else "none"
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"transfer for pool {request.pool_id!r} but the attached pool is {attached!r}",
            )
        n_dev, n_host = dev.num_blocks, host.num_blocks
        plan = TransferPlan(
            fence=request.fence,
            swap_out=_pairs(request.swap_out, n_dev, n_host, "swap_out"),
            swap_in=_pairs(request.swap_in, n_host, n_dev, "swap_in"),
            eager=_pairs(request.eager, n_dev, n_host, "eager"),
        )
        engine = self.engine  # set with self.host at attach
        if engine is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "no pool attached")
        try:
            t = engine.transfer(plan)
        except TransferConflict as e:  # a plan whose copies would race: a scheduler bug
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except TransferError as e:
            raise Refusal(grpc.StatusCode.INTERNAL, str(e)) from None
        self.transfers += 1
        self.blocks_d2h += t.swap_out_blocks + t.eager_blocks
        self.blocks_h2d += t.swap_in_blocks
        self.busy_s += t.total_s
        self.ordered_batches += t.ordered_blocks > 0
        log.debug("transfer", fence=request.fence, d2h=t.swap_out_blocks + t.eager_blocks,
                  h2d=t.swap_in_blocks, total_s=t.total_s, overlap=round(t.overlap, 2))
        return kvmem_pb2.TransferReply(
            fence=request.fence, d2h_s=t.d2h_s, h2d_s=t.h2d_s, total_s=t.total_s,
            bytes_d2h=t.bytes_d2h, bytes_h2d=t.bytes_h2d,
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
            mode=f"{self.device.kind}+{self.engine.describe()}" if self.device and self.engine
            else "detached",
        )

    # -- pools ---------------------------------------------------------------------------
    def _attach(self, handle: worker_pb2.KVPoolHandle) -> HostMemory:
        """Map the worker's pool, replacing any earlier mapping.

        Host contents survive a re-attach when the block shape is unchanged: after a
        worker restart, synced blocks' host copies are still the request's KV and the
        scheduler may swap them in (DESIGN §6). A different block shape means a different
        model or layout, and a new host pool.
        """
        new = DeviceMapping(handle)
        if self.engine is not None:  # it holds the old mapping's tensor
            self.engine.close()
            self.engine = None
        old, self.device = self.device, new
        if old is not None:
            old.close()
        bb = new.block_bytes
        if len(self.hosts) != new.ranks or not all(
                h.fits(new.block_shape, new.dtype) for h in self.hosts):
            # --host-memory-gib is for all ranks' host pools together.
            _, n = self._sizing.blocks_for(bb * new.ranks)
            self._close_hosts()  # drop the old regions before mapping new ones
            self.hosts = [allocate_host_pool(
                new.block_shape, new.dtype, num_blocks=n, numa_node=self._numa,
                device=handle.device_index if new.kind == "cuda_ipc" else None)
                for _ in range(new.ranks)]
            self.host = self.hosts[0]
            self.host_pool_id = uuid.uuid4().hex
            log.info("host_pool", host_blocks=n, block_bytes=bb, ranks=new.ranks,
                     detail=self.host.description)
        # Not strict: a swap-in that overwrites a block this batch copies out runs after
        # that copy (counted in ordered_batches) instead of failing the batch.
        self.engine = RankedEngine(new.tensors, [h.tensor for h in self.hosts], self._mode,
                                   strict=False)
        log.info("transfer_engine", engine=self.engine.describe())
        log.info("attached", pool_id=new.pool_id, kind=new.kind, device_blocks=new.num_blocks,
                 ranks=new.ranks, replaced=old.pool_id if old else None)
        return self.hosts[0]

    async def close(self) -> None:
        await self._lane.run(self._close)
        self._lane.close()

    def _close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.device is not None:
            self.device.close()
            self.device = None
        self._close_hosts()

    def _close_hosts(self) -> None:
        for h in self.hosts:
            h.close()
        self.hosts = []
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


class KVMemDaemon(Daemon):
    name = "kvmem"

    def __init__(self, args: argparse.Namespace) -> None:
        self.service = KVMemService(args.host_blocks, args.host_memory_gib,
                                    args.transfer_mode, args.numa_node)

    def register(self, server: grpc.aio.Server) -> None:
        kvmem_pb2_grpc.add_KVMemServicer_to_server(self.service, server)

    async def start(self) -> None:
        # The copy path's glibc setting (kvmem_svc/tunables.py), so a log says what ran.
        log.info("copy_tunables", nt_threshold=nt_threshold_in_effect() or "glibc default")
        log.info("waiting_for_attach")  # the host pool is sized at the first AttachPool

    async def stop(self) -> None:
        await self.service.close()


def main(args: argparse.Namespace) -> int:
    reexec_with_copy_tunables()  # no-op when `superinfer kvmem` already did it before torch
    return run_daemon(KVMemDaemon(args), args)
