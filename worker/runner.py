"""Model runner: owns the model and the device KV pool, executes scheduled batches.

Stateless about requests: every chunk carries its tokens, positions and block table, so a
restarted worker can pick up any request the scheduler still knows (DESIGN §6). It runs
on the thread worker/batches.py gives it (not the event loop's), and the C++ forward
releases the GIL, so the scheduler plans the next iteration meanwhile. The one exception
to statelessness is a cache the scheduler can always rebuild: the sampling state of requests
with penalties, logit bias or a grammar (`worker/sampling_state.py`).

Sampling, in `execute`: the forward pass returns the logits of each sampled row (and, for
echo, of every row whose prompt logprobs were asked for); `logits_processing.process`
applies penalties, bias and grammar masks to the sampled rows; the sampler chooses; the
raw logits give the logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from common.contracts import ExecuteResult, KVShape, ScheduledChunk
from worker.attention import build_meta
from worker.logits_processing import batch_result, process
from worker.model import LlamaModel
from worker.model_config import ModelConfig
from worker.sampler import sample_tokens
from worker.sampling_state import SamplingStates
from worker.threads import ThreadTuner, default_choices
from worker.tp import TPGroup


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return KVShape(1, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim).block_bytes(itemsize)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_pool: torch.Tensor, block_size: int,
                 weights: str, sampling: SamplingStates | None = None,
                 tuner: ThreadTuner | None = None, group: TPGroup | None = None) -> None:
        """`weights`: the model's weight set to run (worker/formats.py names them);
        `sampling`: the per-request sampling state (None: one without grammars);
        `tuner`: None picks 1 .. torch's thread count by measurement;
        `group`: tensor parallel, as rank 0 (the model is this rank's shard; every
        forward first sends the batch to the other ranks, worker/tp.py)."""
        if kv_pool.shape[3] != block_size:
            raise ValueError("KV pool block size does not match")
        if weights not in model.sets:
            raise ValueError(f"the model has no weight set {weights!r}")
        self.model = model
        self.kv = kv_pool
        self.block_size = block_size
        self.weights = weights
        self.group = group
        self.tuner = tuner or ThreadTuner(default_choices(torch.get_num_threads()))
        self.sampling = sampling if sampling is not None else SamplingStates(model.cfg.vocab_size)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits of the chunks that sample, in their order ([S, V]), then of the rows
        whose prompt logprobs are asked for (echo), in chunk order."""
        meta = build_meta(chunks, self.block_size)
        if self.group is not None:
            return self.group.lockstep(
                chunks, lambda: self.model.forward(self.weights, meta, self.kv))
        return self.model.forward(self.weights, meta, self.kv)

    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        t0 = time.perf_counter()
        if not chunks:
            return ExecuteResult(sampled={}, execute_s=0.0)
        samplers = [c for c in chunks if c.sample]
        # Before the forward pass: it needs only the tokens, and a state that cannot be
        # brought up to date fails the batch before it writes any KV.
        params = self.sampling.params(samplers)
        self.tuner.begin(sum(len(c.token_ids) for c in chunks))
        logits = self.forward(chunks)
        raw = logits[: len(samplers)]
        tokens = sample_tokens(process(raw, params), samplers)
        self.tuner.end(time.perf_counter() - t0)
        return batch_result(logits, chunks, samplers, tokens, time.perf_counter() - t0)

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: drop their sampling state."""
        self.sampling.release(request_ids)
