"""Which device the worker computes on, and whether its KV pool fits there.

Torch only, no Triton: the worker calls this before it knows it takes the CUDA path, and
on a machine without CUDA (or without Triton) `--device auto` must still give the CPU.
"""

from __future__ import annotations

import importlib.util

import torch

from common.errors import SuperInferError
from common.pool_handle import encode_cuda_ipc
from worker.kv_pool import DevicePool

DEVICES = ("auto", "cpu", "cuda")
GIB = 1 << 30
# Device memory left free beside the weights and the pool: activations of a 512-token
# prefill, the CUDA graphs' pool, cuBLAS workspaces, Triton's compiled kernels.
DEFAULT_HEADROOM_BYTES = 2 * GIB


class DeviceError(SuperInferError):
    """The requested device is missing, or what it must hold does not fit."""

    code = "device_error"


def resolve_device(flag: str, cuda_available: bool | None = None,
                   triton_available: bool | None = None) -> str:
    """'cpu' or 'cuda' for `--device auto|cpu|cuda` (auto: CUDA when torch sees it)."""
    if flag not in DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)}, got {flag!r}")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if flag == "cpu" or (flag == "auto" and not cuda):
        return "cpu"
    if not cuda:
        raise DeviceError(
            f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, built for "
            f"CUDA {torch.version.cuda or 'none'}; torch.cuda.is_available() is false). "
            "Use --device cpu, or --device auto to take the GPU only when there is one")
    triton = (importlib.util.find_spec("triton") is not None if triton_available is None
              else triton_available)
    if not triton:
        raise DeviceError("--device cuda needs Triton for its kernels: pip install "
                          "'superinfer[gpu]' (CUDA 12) or 'superinfer[gpu-cuda13]'")
    return "cuda"


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_pool_fits(num_blocks: int, block_bytes: int, free_bytes: int, total_bytes: int,
                    headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> None:
    """Refuse, before anything is allocated, a pool that leaves less than `headroom_bytes`
    of the GPU's free memory (measured after the weights are on it)."""
    need = num_blocks * block_bytes
    if need + headroom_bytes > free_bytes:
        fit = max(0, (free_bytes - headroom_bytes) // block_bytes)
        raise DeviceError(
            f"the device KV pool does not fit on the GPU: {num_blocks} blocks x "
            f"{block_bytes / 2**20:.2f} MiB = {gib(need)}, plus {gib(headroom_bytes)} kept "
            f"for activations and CUDA graphs, but only {gib(free_bytes)} of the GPU's "
            f"{gib(total_bytes)} are free after the weights. At most {fit} blocks fit: lower "
            "--device-blocks or --kv-memory-gib")


def allocate_cuda_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
                       ) -> torch.Tensor:  # pragma: no cover - UNTESTED here: needs CUDA
    """The zeroed pool [blocks, L, 2, bs, Hkv, D] on `device`, or a DeviceError naming the
    sizes; an allocation that fails anyway leaves nothing allocated behind it."""
    num_blocks = shape[0]
    block_bytes = int(torch.empty(shape[1:], dtype=dtype, device="meta").numel()
                      * torch.empty(0, dtype=dtype).element_size())
    free, total = torch.cuda.mem_get_info(device)
    check_pool_fits(num_blocks, block_bytes, free, total, headroom_bytes)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise DeviceError(f"the device KV pool ({num_blocks} blocks, "
                          f"{gib(num_blocks * block_bytes)}) could not be allocated although "
                          f"{gib(free)} were free: lower --device-blocks") from None


def cuda_device_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     headroom_bytes: int = DEFAULT_HEADROOM_BYTES
                     ) -> DevicePool:  # pragma: no cover - UNTESTED here: needs CUDA
    """The worker's device pool on the GPU, exported with a CUDA IPC handle that kvmem
    opens (kvmem_svc/pool.py) from the pool handle message."""
    tensor = allocate_cuda_pool(shape, dtype, device, headroom_bytes)
    return DevicePool(tensor, "cuda_ipc",
                      cuda_ipc=encode_cuda_ipc(tensor.untyped_storage()._share_cuda_()))
