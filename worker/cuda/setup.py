"""The worker's CUDA executor, built from loaded weights: the model, the pool, the runner.

`worker/service.py` calls `load_cuda` for `--device cuda` (and `auto` on a GPU machine)
in place of the CPU's LlamaModel + shared-memory pool + ModelRunner. The pool is exported
with a CUDA IPC handle for kvmem, in the same KVPoolHandle message as the CPU's segment.
UNTESTED here (no GPU): every part it joins has a CPU test; the joining needs a GPU.
"""

from __future__ import annotations

import structlog
import torch

from common.config import EngineConfig
from worker.cuda.device import cuda_device_pool
from worker.cuda.model import CudaLlama
from worker.cuda.runner import CudaModelRunner
from worker.kv_pool import DevicePool
from worker.model_config import ModelConfig
from worker.sampling_state import SamplingStates

log = structlog.get_logger()
MAX_GRAPH_BATCH = 256  # decode batches up to this many sequences replay a CUDA graph


def load_cuda(mcfg: ModelConfig, weights: dict[str, torch.Tensor], shape: tuple[int, ...],
              dtype: torch.dtype, config: EngineConfig, sampling: SamplingStates
              ) -> tuple[CudaModelRunner, DevicePool]:  # pragma: no cover - needs CUDA
    device = torch.device("cuda", torch.cuda.current_device())
    model = CudaLlama(mcfg, weights, device, dtype)  # weights first: the pool gets the rest
    pool = cuda_device_pool(shape, dtype, device)
    runner = CudaModelRunner(model, pool.tensor, config.block_size,
                             max_batch=min(config.max_num_seqs, MAX_GRAPH_BATCH),
                             max_model_len=config.max_model_len, sampling=sampling)
    log.info("cuda_executor", gpu=torch.cuda.get_device_name(device), dtype=str(dtype),
             weights_gib=round(model.weight_bytes / 2**30, 2),
             graph_buckets=list(runner.plan.buckets) if runner.graphs else [])
    return runner, pool
