"""The worker's gRPC service (proto Worker): model weights, the device KV pool, Execute.

It keeps no request state: every chunk carries its tokens, positions and block table,
and the pool id on each batch tells a restarted worker's new pool from the old one.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
import torch

from common.config import EngineConfig
from common.contracts import PLACEHOLDER, KVShape, ScheduledChunk
from common.daemon import Daemon, run_daemon
from common.dtypes import DTYPE_NAMES, DTYPES
from common.errors import SuperInferError
from common.modelfile import ModelSource, resolve_model
from common.shm import SegmentRecord
from common.tokenizer import Tokenizer
from common.wire import chunk_from_proto, result_to_proto
from proto import scheduler_pb2, worker_pb2, worker_pb2_grpc
from worker.batches import BatchRunner, OutOfOrder
from worker.build import BuiltModel, build_model, build_shard, shard_pool_shape
from worker.cuda.device import DeviceError, resolve_device
from worker.grammar import GrammarBank
from worker.kv_pool import DevicePool
from worker.loader import load_weights
from worker.model_config import ModelConfig
from worker.runner import ModelRunner, kv_block_bytes
from worker.sampling_state import MissingState, SamplingStates
from worker.threads import ThreadTuner
from worker.tp import (
    TPGroup,
    check_source,
    join_group,
    master_store,
    start_ranks,
    stop_ranks,
    threads_per_rank,
    watch_ranks,
)

if TYPE_CHECKING:
    from worker.cuda.runner import CudaModelRunner

log = structlog.get_logger()

MAX_LOGPROBS = 20  # top logprobs per token (the scheduler's SamplingParams limit)

# On the CPU the pool is a shared-memory segment; on CUDA (worker/cuda/, `--device`) the
# pool is a GPU tensor exported with a CUDA IPC handle.
POOL_DEVICE = "cpu"


def cuda_dtype(requested: str) -> torch.dtype:
    """--dtype on the CUDA worker: dense weights; auto is bfloat16, and the CPU executor's
    quantized formats (int8, int4, gguf) run as bfloat16 there, with a warning."""
    if requested in DTYPES:
        return DTYPES[requested]
    if requested != "auto":
        log.warning("dtype_fallback", requested=requested, using="bfloat16",
                    why="the CUDA worker runs dense weights only")
    return torch.bfloat16


@dataclass(slots=True)
class Loaded:
    runner: ModelRunner | CudaModelRunner
    pool: DevicePool
    info: scheduler_pb2.ModelInfo
    batches: BatchRunner  # one forward at a time, in the scheduler's order


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: EngineConfig, run_dir: Path | None = None,
                 log_level: str = "info") -> None:
        self.config = config
        self.loaded: Loaded | None = None
        self.run_dir = run_dir
        self.log_level = log_level
        self.tp: TPRanks | None = None  # --tensor-parallel-size > 1: the other ranks
        # Our pool's segment name, so that a worker killed with SIGKILL leaves no segment
        # behind: the next one (or the supervisor) unlinks it (common/shm.py).
        self.segments = SegmentRecord(run_dir / "worker.shm") if run_dir else None

    async def load(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        device = resolve_device(cfg.device)
        built: BuiltModel | None = None
        if cfg.tensor_parallel_size > 1:
            if device != "cpu":
                raise DeviceError("--tensor-parallel-size > 1 runs on the CPU worker only so "
                                  "far (worker/tp.py); use --device cpu")
            await self._load_tp(t0)
            return
        if device == "cpu":  # the CPU executor: its format by --dtype (worker/formats.py)
            built = await asyncio.to_thread(build_model, cfg.model, cfg.dtype, cfg.kv_dtype)
            source, mcfg, dtype, fmt = built.source, built.model.cfg, built.kv_dtype, built.weights
            weights: dict[str, torch.Tensor] = {}
        elif device == "cuda":
            dtype = cuda_dtype(cfg.dtype)
            source = resolve_model(cfg.model)
            mcfg, weights = await asyncio.to_thread(load_weights, source.path, source.kind, dtype)
            fmt = DTYPE_NAMES[dtype]
        else:
            raise DeviceError(f"no executor for device {device!r}")
        num_blocks, _ = cfg.blocks_for(kv_block_bytes(mcfg, cfg.block_size, dtype))
        shape = KVShape(num_blocks, mcfg.num_layers, cfg.block_size, mcfg.num_kv_heads,
                        mcfg.head_dim)
        if self.segments is not None:
            reaped = self.segments.reap()
            if reaped:
                log.warning("reaped_shm", segments=reaped,
                            why="left in /dev/shm by a worker that was killed")
        # Nothing may fail between making the pool and recording it (stop() unlinks it).
        # A stop during the load above cancels this coroutine there: no pool is made.
        runner: ModelRunner | CudaModelRunner
        sampling = _sampling_states(source, mcfg.vocab_size)
        if built is not None:
            pool = DevicePool.create(shape.shape, dtype, POOL_DEVICE)
            runner = ModelRunner(built.model, pool.tensor, cfg.block_size, built.weights,
                                 sampling)
        else:
            from worker.cuda.setup import load_cuda  # Triton loads only on this path

            runner, pool = await asyncio.to_thread(load_cuda, mcfg, weights, shape.shape,
                                                   dtype, cfg, sampling)
        self._loaded(runner, pool, _model_info(source, mcfg, cfg.block_size, fmt), device, t0)

    def _loaded(self, runner: ModelRunner | CudaModelRunner, pool: DevicePool,
                info: scheduler_pb2.ModelInfo, device: str, t0: float) -> None:
        self.loaded = Loaded(runner, pool, info, BatchRunner(runner.execute, runner.release))
        handle = pool.handle()
        if self.segments is not None and handle.shm_name:
            self.segments.add(handle.shm_name)
        log.info("loaded", model=info.name, weights=info.dtype, device=device,
                 device_blocks=pool.num_blocks, pool_gib=round(handle.nbytes / 2**30, 3),
                 pool_id=pool.pool_id, pool=handle.shm_name or handle.kind,
                 tensor_parallel=self.config.tensor_parallel_size,
                 load_s=round(time.perf_counter() - t0, 2))

    async def _load_tp(self, t0: float) -> None:
        """Rank 0 of a tensor-parallel group (worker/tp.py): start the other ranks, join
        the group, build this rank's shard and pool; every rank's pool goes in the handle."""
        cfg, n = self.config, self.config.tensor_parallel_size
        source = resolve_model(cfg.model)
        check_source(n, source)  # before any rank starts
        run_dir = self.run_dir or Path(tempfile.mkdtemp(prefix="superinfer-tp-"))
        records = [SegmentRecord(run_dir / f"worker.rank{r}.shm") for r in range(1, n)]
        for r, record in enumerate([self.segments, *records]):  # the last group's leftovers
            reaped = record.reap() if record is not None else []
            if reaped:
                log.warning("reaped_shm", rank=r, segments=reaped,
                            why="left in /dev/shm by a worker group that was killed")
        threads = threads_per_rank(n)
        store = master_store(n)
        # On this (the main) thread: the ranks' PR_SET_PDEATHSIG follows the forking thread.
        tp = TPRanks(start_ranks(n, store, asdict(cfg), run_dir, self.log_level), store)
        self.tp = tp
        tp.watch = watch_ranks(tp.procs, tp.stopping,
                               lambda: tp.group.busy_since if tp.group is not None else 0.0)
        shard = await asyncio.to_thread(build_shard, cfg, 0, n)
        tp.group = await asyncio.to_thread(join_group, 0, n, store)
        shard.model.reduce = tp.group.all_reduce
        names = await asyncio.to_thread(
            lambda: [store.get(f"shm/{r}").decode() for r in range(1, n)])
        pool = DevicePool.create(shard_pool_shape(cfg, shard), shard.kv_dtype, POOL_DEVICE)
        pool.shards = [pool.handle().shm_name, *names]
        sampling = _sampling_states(source, shard.model.cfg.vocab_size)
        runner = ModelRunner(shard.model, pool.tensor, cfg.block_size, shard.weights, sampling,
                             ThreadTuner((threads,)), group=tp.group)
        self._loaded(runner, pool, _model_info(source, shard.full, cfg.block_size, shard.weights),
                     "cpu", t0)

    def close(self) -> None:
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            loaded.batches.close()  # waits for a forward still writing the pool
            loaded.runner.kv = torch.empty(0)  # drop the last view before unmapping
            name = loaded.pool.handle().shm_name
            loaded.pool.close()
            if self.segments is not None and name:
                self.segments.remove(name)
        tp, self.tp = self.tp, None
        if tp is not None:
            tp.close()

    async def _ready(self, context: grpc.aio.ServicerContext) -> Loaded:
        loaded = self.loaded
        if loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
            raise RuntimeError("not reached: abort raises")
        return loaded

    # -- gRPC ------------------------------------------------------------------------------
    async def Execute(
        self, request: worker_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ExecuteReply:
        w = await self._ready(context)
        if request.pool_id != w.pool.pool_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"batch for pool {request.pool_id!r}; this worker's pool is {w.pool.pool_id!r}",
            )
        chunks = [chunk_from_proto(c) for c in request.chunks]
        problem = _check_chunks(chunks, w.pool.num_blocks, w.runner.block_size,
                                w.info.vocab_size)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            result = await w.batches.run(request.iteration, request.after_iteration, chunks,
                                         list(request.released))
        except (OutOfOrder, MissingState) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return result_to_proto(result)

    async def GetKVPool(
        self, request: worker_pb2.KVPoolRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVPoolHandle:
        loaded = await self._ready(context)
        # After every batch already sent: a scheduler recovering from a failed batch (say,
        # past its deadline) learns the pool only once that batch stopped writing to it.
        await loaded.batches.barrier()
        return loaded.pool.handle()

    async def GetModelInfo(
        self, request: scheduler_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ModelInfo:
        return (await self._ready(context)).info


def _sampling_states(source: ModelSource, vocab_size: int) -> SamplingStates:
    """The runner's per-request sampling state. Grammars need the tokenizer; it is built
    the first time one comes (~1 s)."""
    return SamplingStates(vocab_size, lambda: GrammarBank(Tokenizer.from_source(source),
                                                          vocab_size))


def _model_info(source: ModelSource, mcfg: ModelConfig, block_size: int, fmt: str
                ) -> scheduler_pb2.ModelInfo:
    return scheduler_pb2.ModelInfo(
        name=source.name,
        max_model_len=mcfg.max_position,
        vocab_size=mcfg.vocab_size,
        num_layers=mcfg.num_layers,
        num_kv_heads=mcfg.num_kv_heads,  # the model's (a TP rank's pool holds 1/N of them)
        head_dim=mcfg.head_dim,
        block_size=block_size,
        # the executor format (its KV cache matches it: scheduler_svc model_identity)
        dtype=fmt,
        source_kind=source.kind,
        source_path=str(source.path),
    )


@dataclass(slots=True)
class TPRanks:
    """Rank 0's hold on ranks 1..N-1: their processes, the store, the group."""

    procs: list[subprocess.Popen[bytes]]
    store: object
    group: TPGroup | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    watch: threading.Thread | None = None

    def close(self) -> None:
        """Tell the ranks to stop (they free their pools), then wait for them."""
        self.stopping.set()
        if self.group is not None:
            try:
                self.group.send_batch(None)
            except Exception as e:  # a rank already gone: kill the rest below
                log.warning("tp_stop_failed", error=str(e))
                for p in self.procs:
                    p.kill()
            self.group.close()
        else:
            for p in self.procs:  # still loading: nothing to tell them
                p.kill()
        stop_ranks(self.procs)


def _check_chunks(chunks: list[ScheduledChunk], num_blocks: int, block_size: int,
                  vocab: int) -> str | None:
    """A malformed batch must come back as an error, not crash the forward pass."""
    for c in chunks:
        end = c.start_pos + len(c.token_ids)
        if not c.token_ids or c.start_pos < 0:
            return f"{c.request_id}: empty chunk or negative start position"
        if len(c.block_table) * block_size < end:
            return f"{c.request_id}: block table covers fewer than {end} positions"
        if any(not 0 <= b < num_blocks for b in c.block_table):
            return f"{c.request_id}: block table names a block outside the pool ({num_blocks})"
        # The last token may be PLACEHOLDER: the previous batch's sample (worker/batches.py).
        if any(not 0 <= t < vocab for t in c.token_ids[:-1]) or not (
            0 <= c.token_ids[-1] < vocab or c.token_ids[-1] == PLACEHOLDER
        ):
            return f"{c.request_id}: token id outside the vocabulary ({vocab})"
        if len(c.prompt_logprob_targets) > len(c.token_ids) or any(
                not 0 <= t < vocab for t in c.prompt_logprob_targets):
            return f"{c.request_id}: bad prompt logprob targets"
        if c.logprobs > MAX_LOGPROBS:
            return f"{c.request_id}: at most {MAX_LOGPROBS} top logprobs"
        if c.state is not None and any(not 0 <= t < vocab for t in c.state.logit_bias):
            return f"{c.request_id}: logit bias token id outside the vocabulary ({vocab})"
    return None


class WorkerDaemon(Daemon):
    name = "worker"

    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_grad_enabled(False)
        self.service = WorkerService(EngineConfig.from_args(args), Path(args.run_dir),
                                     args.log_level)

    def register(self, server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_WorkerServicer_to_server(self.service, server)

    async def start(self) -> None:
        await self.service.load()

    async def stop(self) -> None:
        self.service.close()


def main(args: argparse.Namespace) -> int:
    try:  # a device that is not there is one line, not a traceback in the log
        device = resolve_device(getattr(args, "device", "auto"))
        if getattr(args, "tensor_parallel_size", 1) != 1:
            if device != "cpu":
                raise DeviceError("--tensor-parallel-size > 1 runs on the CPU worker only so "
                                  "far (worker/tp.py); add --device cpu")
            check_source(args.tensor_parallel_size, resolve_model(args.model))
    except (DeviceError, SuperInferError) as e:
        print(f"superinfer worker: {e}", file=sys.stderr)
        return 2
    return run_daemon(WorkerDaemon(args), args)
