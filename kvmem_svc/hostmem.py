"""The host KV pool's memory: one anonymous mapping, NUMA-bound, pre-faulted, pinned on a GPU.

Allocated once, at the size asked for (blocks or GiB), in this order:
1. `mmap` anonymous, private; transparent huge pages advised (fewer TLB misses over a
   pool of tens of GiB) and excluded from fork (a child must not share pinned pages).
2. NUMA: bound (`mbind` through libnuma, via ctypes) to the node nearest the GPU — the
   node of its PCI device in sysfs — or to the node asked for; before any page exists, so
   every page is placed there. Where that is impossible (one node, no libnuma, no GPU to
   be near) nothing is bound and the description says why.
3. Pre-fault, so no copy pays a page fault (DESIGN §5): in the background with
   MADV_POPULATE_WRITE where the kernel has it (it fills page tables without touching the
   data, so copies may run beside it: first-touching 2 GiB took 16 s in a VM here, time
   kvmem was not serving), else one write per page before serving.
4. On a GPU, page-locked in place with `cudaHostRegister` (kvmem_svc/cuda_copy.py).

`describe` of the result is one line for the daemon's log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.shm import prefault
from kvmem_svc.cuda_copy import CudaRuntime

NODE_DIR = Path("/sys/devices/system/node")
_MPOL_PREFERRED, _MPOL_BIND = 1, 2
GIB = 1 << 30


@dataclass(slots=True)
class HostMemory:
    tensor: torch.Tensor  # [num_blocks, *block_shape]
    region: mmap.mmap | None
    description: str
    numa_node: int | None = None  # node the pages are bound (or preferred) to
    pinned: bool = False

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[1:])

    def fits(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Can this pool hold blocks of that shape and dtype (so it survives a re-attach)?"""
        return self.block_shape == tuple(block_shape) and self.tensor.dtype == dtype

    def close(self) -> None:
        """Unpin and unmap. The mapping outlives this call while other views of it exist."""
        if self.pinned:
            rt = CudaRuntime.load()
            if rt is not None:
                rt.host_unregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty((0, *self.tensor.shape[1:]), dtype=self.tensor.dtype)
        if self.region is not None:
            region, self.region = self.region, None
            try:
                region.close()
            except BufferError:
                pass  # a view of the pool is still alive; the pages go with it


def allocate_host_pool(
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    num_blocks: int | None = None,
    gib: float | None = None,
    numa_node: str | int = "auto",
    pin: bool | str = "auto",
    device: torch.device | int | None = None,
) -> HostMemory:
    """Allocate the host pool: `num_blocks` blocks, or as many as fit in `gib` GiB.

    numa_node: "auto" (the node nearest `device`, or the current CUDA device), a node
    number (int or digits, as a command line gives it), or "off".
    pin: "auto" (when CUDA is available), True or False.
    """
    block_bytes = math.prod(block_shape) * torch.empty(0, dtype=dtype).element_size()
    if (num_blocks is None) == (gib is None):
        raise ValueError("give exactly one of num_blocks and gib")
    n = num_blocks if num_blocks is not None else blocks_in(gib or 0.0, block_shape, dtype)
    if n < 0 or block_bytes <= 0:
        raise ValueError(f"cannot allocate {n} blocks of {block_bytes} bytes")
    shape = (n, *block_shape)
    nbytes = n * block_bytes
    head = f"host pool: {n} blocks x {block_bytes / 2**20:.3g} MiB = {nbytes / GIB:.3g} GiB"
    if nbytes == 0:
        return HostMemory(torch.empty(shape, dtype=dtype), None, f"{head} (empty)")

    notes = ["mmap anonymous"]
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice, name in ((getattr(mmap, "MADV_HUGEPAGE", None), "THP advised"),
                         (getattr(mmap, "MADV_DONTFORK", None), "not inherited by fork")):
        if advice is not None:
            try:
                region.madvise(advice)
                notes.append(name)
            except OSError:
                pass
    tensor = torch.frombuffer(region, dtype=dtype, count=math.prod(shape)).view(shape)

    cuda_index = _cuda_index(device)
    node, how = _bind(tensor.data_ptr(), nbytes, numa_node, cuda_index)
    notes.append(how)

    pinning = pin is True or (pin == "auto" and cuda_index is not None)
    if not pinning and populate_in_background(tensor.data_ptr(), nbytes):
        notes.append("pre-faulting in the background (MADV_POPULATE_WRITE)")
    else:  # pinning faults every page in anyway; without the advice, before serving
        t0 = time.perf_counter()
        prefault(tensor, write=True)
        notes.append(f"pre-faulted in {time.perf_counter() - t0:.2f} s")

    pinned = False
    if pinning:
        rt = CudaRuntime.load()
        if rt is None:
            if pin is True:
                raise RuntimeError("pin=True needs CUDA and libcudart")
            notes.append("not pinned (no libcudart)")
        else:
            t0 = time.perf_counter()
            rt.host_register(tensor.data_ptr(), nbytes)
            pinned = True
            notes.append(f"pinned (cudaHostRegister) in {time.perf_counter() - t0:.2f} s")
    else:
        notes.append("not pinned (no GPU)" if cuda_index is None else "not pinned (pin=False)")
    return HostMemory(tensor, region, f"{head}: {', '.join(notes)}", node, pinned)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: populate page tables writable, data untouched
POPULATE_CHUNK = 64 << 20


def populate_in_background(addr: int, nbytes: int) -> bool:
    """Fault `nbytes` at `addr` in, writable, from a daemon thread; False where the kernel
    lacks MADV_POPULATE_WRITE (the first chunk is advised here, to find out). ctypes
    releases the GIL around each call, so the service's threads run beside it; a chunk
    that fails (the pool was unmapped) ends it."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def advise(start: int) -> bool:
        n = min(POPULATE_CHUNK, nbytes - start)
        return bool(madvise(addr + start, n, MADV_POPULATE_WRITE) == 0)

    if not advise(0):
        return False

    def rest() -> None:
        for start in range(POPULATE_CHUNK, nbytes, POPULATE_CHUNK):
            if not advise(start):
                return

    threading.Thread(target=rest, name="kvmem-populate", daemon=True).start()
    return True


def blocks_in(gib: float, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(gib * GIB // (math.prod(block_shape) * torch.empty(0, dtype=dtype).element_size()))


# -- NUMA -------------------------------------------------------------------------------------
def online_nodes() -> list[int]:
    """NUMA nodes with memory, from sysfs; [] where sysfs says nothing."""
    try:
        text = (NODE_DIR / "has_memory").read_text().strip() or (NODE_DIR / "online").read_text()
    except OSError:
        return []
    nodes: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo:
            nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes


def gpu_numa_node(index: int) -> int | None:
    """The NUMA node of CUDA device `index`'s PCI function, None when unknown."""
    rt = CudaRuntime.load()
    if rt is None:
        return None
    try:
        bdf = rt.pci_bus_id(index)
        node = int(Path(f"/sys/bus/pci/devices/{bdf}/numa_node").read_text())
    except (OSError, ValueError, RuntimeError):
        return None
    return node if node >= 0 else None


def _cuda_index(device: torch.device | int | None) -> int | None:
    """The GPU the pool serves: `device`, else the current CUDA device, else None."""
    if isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        return (device.index or 0) if device.type == "cuda" else None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _bind(addr: int, nbytes: int, choice: str | int, cuda_index: int | None) -> tuple[int | None, str]:
    """Apply the NUMA policy to [addr, addr+nbytes) before it is touched: (node, what was done)."""
    if choice == "off":
        return None, "NUMA binding off"
    if isinstance(choice, str) and choice.isdigit():
        choice = int(choice)
    nodes = online_nodes()
    if isinstance(choice, int):
        if nodes and choice not in nodes:
            raise ValueError(f"NUMA node {choice} does not exist (nodes: {nodes})")
        node = choice
    elif choice == "auto":
        if len(nodes) <= 1:
            return None, "NUMA: one node, nothing to bind"
        near = gpu_numa_node(cuda_index) if cuda_index is not None else None
        if near is None:
            why = "no GPU" if cuda_index is None else f"GPU {cuda_index} reports no NUMA node"
            return None, f"NUMA: not bound ({why}; nodes {nodes})"
        node = near
    else:
        raise ValueError(f"numa_node must be 'auto', 'off' or a node number, got {choice!r}")
    lib = _libnuma()
    if lib is None:
        return None, f"NUMA: not bound to node {node} (libnuma not found)"
    free = _node_free_bytes(node)
    # Strict binding of more than the node has free would end in the OOM killer while
    # pre-faulting; "preferred" spills the rest onto other nodes instead.
    mode, word = ((_MPOL_BIND, "bound to") if free is None or free > nbytes
                  else (_MPOL_PREFERRED, "preferring (too little free memory to bind)"))
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    rc = lib.mbind(addr, nbytes, mode, mask, 64 * len(mask) + 1, 0)
    if rc != 0:
        err = ctypes.get_errno()
        return None, f"NUMA: mbind to node {node} failed ({os.strerror(err)}), not bound"
    return node, f"NUMA {word} node {node} (mbind via libnuma)"


def _libnuma() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("numa") or "libnuma.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    if lib.numa_available() < 0:
        return None
    lib.mbind.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int,
                          ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong, ctypes.c_uint]
    lib.mbind.restype = ctypes.c_long
    return lib


def _node_free_bytes(node: int) -> int | None:
    try:
        for line in (NODE_DIR / f"node{node}" / "meminfo").read_text().splitlines():
            if "MemFree:" in line:
                return int(line.split()[-2]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
