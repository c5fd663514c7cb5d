"""Decode under CUDA graphs: one captured forward per batch-size bucket.

A decode step of a few hundred sequences launches ~9 kernels per layer; launched one by
one from Python each costs more than a small GEMM takes on an H200. A graph per bucket
replays the whole step from one launch. A batch of n decode sequences runs in the smallest
bucket >= n, padded (worker/cuda/batch.py `pad_decode`: padding rows write no KV and are
not sampled). Each bucket owns one packed int32 input buffer on the device at a fixed
address, and one pinned host buffer: a step is one host->device copy and one replay.

Block tables in a graph have a fixed width: enough blocks for `max_model_len` tokens.
The planning below (buckets, padding, which batches qualify) is plain Python and tested on
the CPU; capture and replay are UNTESTED here (no GPU on the development machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from worker.cuda.batch import DeviceBatch, HostBatch, pad_decode

log = structlog.get_logger()

# Finer steps at small batch, where the padding is a larger share of the step.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True, slots=True)
class GraphPlan:
    buckets: tuple[int, ...]
    width: int  # block-table columns of every captured graph

    @classmethod
    def make(cls, max_batch: int, max_model_len: int, block_size: int,
             buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> GraphPlan:
        """Buckets up to `max_batch` (which is always one), tables for max_model_len."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        chosen = tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))
        return cls(chosen, -(-max_model_len // block_size))

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding n sequences; None above the largest."""
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, b: HostBatch) -> bool:
        """Does this batch run as a graph: decode only, few enough rows, tables narrow enough."""
        return (b.is_decode and b.num_seqs > 0 and self.bucket_for(b.num_seqs) is not None
                and int(b.block_tables.shape[1]) <= self.width)

    def padded(self, b: HostBatch) -> HostBatch:
        """`b` as the graph of its bucket reads it: padded rows, tables `width` wide."""
        size = self.bucket_for(b.num_seqs)
        if size is None or not self.fits(b):
            raise ValueError(f"a batch of {b.num_seqs} sequences does not fit the graphs")
        if b.width < self.width:
            wide = np.zeros((b.num_seqs, self.width), np.int32)
            wide[:, : b.width] = b.block_tables
            b = HostBatch(b.input_ids, b.positions, b.slots, b.q_start, b.q_len, b.ctx_start,
                          wide, b.logits_index, b.max_q_len)
        return pad_decode(b, size)


class DecodeGraphs:
    """The captured graphs of one model over one pool (UNTESTED here: needs CUDA)."""

    def __init__(self, model: object, pool: torch.Tensor, plan: GraphPlan) -> None:
        from worker.cuda.model import CudaLlama

        if not isinstance(model, CudaLlama) or pool.device.type != "cuda":
            raise ValueError("CUDA graphs need the CUDA model and a pool on the GPU")
        self.model = model
        self.pool = pool
        self.plan = plan
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor,
                                      torch.Tensor]] = {}
        mempool = torch.cuda.graph_pool_handle()
        for size in sorted(plan.buckets, reverse=True):  # largest first: the pool is reused
            self._capture(size, mempool)

    def _capture(self, size: int, mempool: Any) -> None:
        warm = pad_decode(padding_rows(1, self.plan.width), size)  # writes no KV at all
        host = torch.from_numpy(warm.pack()).pin_memory()
        dev = host.to(self.pool.device)
        batch = DeviceBatch.unpack(dev, size, size, self.plan.width, size, 1)
        side = torch.cuda.Stream(self.pool.device)
        side.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels, warms cuBLAS
                self.model.forward(batch, self.pool)
        torch.cuda.current_stream(self.pool.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            logits = self.model.forward(batch, self.pool)
        self._graphs[size] = (graph, host, dev, logits)

    def run(self, b: HostBatch) -> torch.Tensor:
        """Logits [n, V] of the batch's n rows (a view of the graph's output: read it before
        the next run)."""
        padded = self.plan.padded(b)
        graph, host, dev, logits = self._graphs[padded.num_seqs]
        host.copy_(torch.from_numpy(padded.pack()))
        dev.copy_(host, non_blocking=True)
        graph.replay()
        return logits[: b.num_seqs]


def padding_rows(n: int, width: int) -> HostBatch:
    """n decode rows that write no KV (slot -1) and attend to position 0 of block 0."""
    z = np.zeros(n, np.int32)
    return HostBatch(z, z.copy(), np.full(n, -1, np.int32), np.arange(n, dtype=np.int32),
                     np.ones(n, np.int32), z.copy(), np.zeros((n, width), np.int32),
                     np.arange(n, dtype=np.int32), 1)
