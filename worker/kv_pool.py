"""The device KV pool, allocated so that kvmem can map it from its own process.

On a CPU the pool is a POSIX shared-memory segment; on a GPU it would be a CUDA tensor
exported with a CUDA IPC handle. Either way the worker owns it, a fresh `pool_id` names
each allocation (a restarted worker has a new pool, and stale orders are refused), and
`handle()` says how to map it (proto KVPoolHandle, DESIGN §1).
"""

from __future__ import annotations

import uuid

import torch

from common.dtypes import DTYPE_NAMES
from common.pool_handle import encode_cuda_ipc
from common.shm import SharedTensor, tensor_nbytes
from proto import worker_pb2


class DevicePool:
    def __init__(self, tensor: torch.Tensor, kind: str, shm: SharedTensor | None = None,
                 cuda_ipc: bytes = b"") -> None:
        self.tensor = tensor
        self.kind = kind
        self.pool_id = uuid.uuid4().hex
        self._shm = shm
        self._cuda_ipc = cuda_ipc
        # Tensor parallel: every rank's shard segment, rank order (this one first).
        self.shards: list[str] = []

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> DevicePool:
        """Allocate a zeroed, pre-faulted pool of `shape` [blocks, layers, 2, bs, heads, hd]."""
        if device == "cpu":
            shm = SharedTensor.create(shape, dtype)
            return cls(shm.tensor, "shm", shm=shm)
        if device == "cuda":
            return cls._create_cuda(shape, dtype)
        raise ValueError(f"unknown KV pool device {device!r}; use 'cpu' or 'cuda'")

    @classmethod
    def _create_cuda(cls, shape: tuple[int, ...], dtype: torch.dtype) -> DevicePool:
        # UNTESTED HERE: no CUDA on the development machine. Mirrors what
        # torch.multiprocessing does to send a CUDA tensor to another process;
        # kvmem_svc.pool.map_device_pool opens it with UntypedStorage._new_shared_cuda.
        if not torch.cuda.is_available():
            raise RuntimeError("a CUDA KV pool needs a CUDA device (torch.cuda.is_available())")
        tensor = torch.zeros(shape, dtype=dtype, device="cuda")
        fields = tensor.untyped_storage()._share_cuda_()
        return cls(tensor, "cuda_ipc", cuda_ipc=encode_cuda_ipc(fields))

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def block_bytes(self) -> int:
        return tensor_nbytes(tuple(self.tensor.shape[1:]), self.tensor.dtype)

    def handle(self) -> worker_pb2.KVPoolHandle:
        t = self.tensor
        return worker_pb2.KVPoolHandle(
            pool_id=self.pool_id,
            kind=self.kind,
            shm_name=self._shm.name if self._shm else "",
            cuda_ipc_handle=self._cuda_ipc,
            device_index=t.device.index or 0,
            shape=list(t.shape),
            dtype=DTYPE_NAMES[t.dtype],
            nbytes=t.numel() * t.element_size(),
            shard_shm_names=self.shards,
        )

    def close(self) -> None:
        """Release the pool; the shared-memory name disappears at once."""
        self.tensor = torch.empty(0)  # our view must go before the mapping can
        if self._shm is not None:
            self._shm.close()
            self._shm = None
