"""The worker's CUDA path: the model in bf16 on the GPU over the block-first device pool.

* `kernels.py` — Triton kernels: paged attention (decode, and prefill over a cached prefix)
  reading the pool in place with its block strides, fused RMSNorm, RoPE + KV write, SiLU-mul.
* `batch.py` — a batch of ScheduledChunks as the kernels' int32 arrays, packed for one copy.
* `model.py` — `CudaLlama`, a Llama-family forward in torch + those kernels.
* `graphs.py` — decode under CUDA graphs, one per batch-size bucket (padding planned here).
* `sampler.py` — sampling on the device, repeatable per (seed, output_index).
* `runner.py` — `CudaModelRunner`: ScheduledChunks in, ExecuteResult out, as the CPU runner.
* `random_model.py` — a Llama-3-8B-shaped model with random bf16 weights (speed figures only).

Nothing here is imported on the CPU path (the worker picks it for `--device cuda`). The
code paths that need a GPU (compiled kernels, CUDA graphs, the device pool) are marked
UNTESTED where they are; the CPU tests run everything else, the kernels under Triton's
interpreter.
"""
