"""The CUDA model runner: ScheduledChunks in, ExecuteResult out, as the CPU ModelRunner.

Stateless about requests like the CPU runner (DESIGN §6): every chunk carries its tokens,
positions and block table. A batch of decodes that fits a captured bucket replays its CUDA
graph; anything else (prefill chunks, mixed batches, more rows than the largest bucket)
runs the same forward eagerly. Sampling happens on the device (worker/cuda/sampler.py)
after the CPU runner's logits processing (penalties, logit bias, grammar masks:
worker/logits_processing.py, its parameters moved to the device); the device->host copies
of a step are the sampled token ids and, where asked for, the logprobs.

On CPU tensors (the tests) the eager path runs with the kernels under Triton's
interpreter; graphs and the GPU itself are UNTESTED here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from common.contracts import ExecuteResult, ScheduledChunk
from worker.cuda.batch import DeviceBatch, HostBatch, build_batch
from worker.cuda.graphs import GraphPlan
from worker.cuda.model import CudaLlama
from worker.cuda.sampler import sample_tokens
from worker.logits_processing import batch_result, process
from worker.model_config import ModelConfig
from worker.sampling_state import SamplingStates


class CudaModelRunner:
    def __init__(self, model: CudaLlama, kv_pool: torch.Tensor, block_size: int,
                 max_batch: int = 256, max_model_len: int | None = None,
                 graphs: bool = True, buckets: tuple[int, ...] | None = None,
                 sampling: SamplingStates | None = None) -> None:
        """`sampling`: the per-request sampling state (None: one without grammars)."""
        cfg = model.cfg
        want = (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        if tuple(kv_pool.shape[1:]) != want or kv_pool.dtype != model.dtype:
            raise ValueError(f"KV pool {list(kv_pool.shape)} {kv_pool.dtype} does not match the "
                             f"model: [blocks, {', '.join(map(str, want))}] {model.dtype}")
        if kv_pool.device != model.device:
            raise ValueError(f"KV pool on {kv_pool.device}, model on {model.device}")
        self.model = model
        self.kv = kv_pool
        self.block_size = block_size
        self.sampling = sampling if sampling is not None else SamplingStates(cfg.vocab_size)
        self.max_model_len = min(max_model_len or cfg.max_position, cfg.max_position)
        kw = {"buckets": buckets} if buckets else {}
        self.plan = GraphPlan.make(max_batch, self.max_model_len, block_size, **kw)
        self.graphs = None
        self.graph_steps = 0  # steps that replayed a graph (the rest ran eagerly)
        self.eager_steps = 0
        if graphs and kv_pool.device.type == "cuda":
            from worker.cuda.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv_pool, self.plan)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """fp32 logits [n, V]: one row per chunk with sample=True, in chunk order, then
        the rows whose prompt logprobs are asked for (echo)."""
        b = build_batch(chunks, self.block_size)
        if b.num_tokens and int(b.positions.max()) >= self.max_model_len:
            raise ValueError(f"position {int(b.positions.max())} is past the model's context "
                             f"({self.max_model_len})")
        if self.graphs is not None and self.plan.fits(b):
            self.graph_steps += 1
            full = self.graphs.run(b)  # every row's logits: keep the sampled ones
            return full.index_select(0, torch.from_numpy(b.logits_index).to(full.device).long())
        self.eager_steps += 1
        return self.forward(b)

    def forward(self, b: HostBatch) -> torch.Tensor:
        return self.model.forward(DeviceBatch.from_host(b, self.kv.device), self.kv)

    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        t0 = time.perf_counter()
        if not chunks:
            return ExecuteResult(sampled={}, execute_s=0.0)
        if any(c.num_draft for c in chunks):
            raise ValueError("speculative decoding runs on the CPU executor only so far: "
                             "serve --device cuda without --speculative-config")
        samplers = [c for c in chunks if c.sample]
        # Before the forward pass, as on the CPU: a state that cannot be brought up to date
        # fails the batch before it writes any KV.
        params = self.sampling.params(samplers)
        logits = self.logits(chunks)
        raw = logits[: len(samplers)]
        x = process(raw, params.to(raw.device))
        tokens = sample_tokens(x, samplers) if samplers else []
        return batch_result(logits, chunks, samplers, tokens, time.perf_counter() - t0)

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: drop their sampling state."""
        self.sampling.release(request_ids)
