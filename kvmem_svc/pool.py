"""kvmem's view of the worker's device pool, mapped from the worker's handle.

The host pool (kvmem_svc/hostmem.py) has the device pool's block shape (DESIGN §2), so it
is allocated at the first attach, once the handle says what a block is.
"""

from __future__ import annotations

import torch

from common.dtypes import DTYPES
from common.pool_handle import decode_cuda_ipc
from common.shm import SharedTensor, tensor_nbytes
from proto import worker_pb2


class DeviceMapping:
    """This process's view of the worker's device pool, from its KVPoolHandle."""

    def __init__(self, handle: worker_pb2.KVPoolHandle) -> None:
        if handle.dtype not in DTYPES:
            raise ValueError(f"unknown KV pool dtype {handle.dtype!r}")
        shape = tuple(int(n) for n in handle.shape)
        if len(shape) != 6 or min(shape) < 1:
            raise ValueError(f"KV pool shape must be 6 positive sizes, got {list(shape)}")
        self.pool_id = handle.pool_id
        self.shape = shape
        self.dtype = DTYPES[handle.dtype]
        self._shms: list[SharedTensor] = []
        if handle.kind == "shm":
            # Tensor parallel: every rank's shard (same shape and block ids), rank order.
            for name in list(handle.shard_shm_names) or [handle.shm_name]:
                try:
                    self._shms.append(SharedTensor.attach(name, shape, self.dtype))
                except BaseException:
                    self.close()
                    raise
            self.tensors = [s.tensor for s in self._shms]
        elif handle.kind == "cuda_ipc":
            if handle.shard_shm_names:
                raise ValueError("a tensor-parallel pool on CUDA is not supported")
            self.tensors = [_open_cuda_ipc(handle, shape, self.dtype)]
        else:
            raise ValueError(f"unknown KV pool kind {handle.kind!r}")
        self.tensor = self.tensors[0]

    @property
    def kind(self) -> str:
        return "shm" if self._shms else "cuda_ipc"

    @property
    def ranks(self) -> int:
        """Tensor-parallel ranks whose pools this maps (1 without TP)."""
        return len(self.tensors)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_bytes(self) -> int:
        return tensor_nbytes(self.block_shape, self.dtype)

    def close(self) -> None:
        self.tensor = torch.empty(0)
        self.tensors = []
        for shm in self._shms:
            shm.close()
        self._shms = []


def _open_cuda_ipc(
    handle: worker_pb2.KVPoolHandle, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    # UNTESTED HERE (no CUDA on the development machine): the receiving half of
    # worker.kv_pool.DevicePool._create_cuda, as torch.multiprocessing rebuilds a tensor.
    if not torch.cuda.is_available():
        raise RuntimeError("the worker's KV pool is on CUDA but this process sees no CUDA device")
    fields = decode_cuda_ipc(handle.cuda_ipc_handle)
    torch.cuda.set_device(handle.device_index)
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    t = torch.empty(0, dtype=dtype, device=f"cuda:{handle.device_index}")
    stride = torch.empty(shape, device="meta").stride()  # contiguous, like the worker's
    return t.set_(storage, 0, shape, stride)
