"""DuplexKV on a GPU: two copy streams, one batched memcpy per direction, pinned host memory.

UNTESTED: written on a machine without CUDA. Every line here runs only behind
`torch.cuda.is_available()`; the `gpu`-marked tests in tests/test_duplex.py exercise it.

* Two non-default streams, one per direction, so device->host and host->device copies
  use both copy engines at once (full duplex on PCIe and NVLink-C2C alike).
* `cudaMemcpyBatchAsync` (CUDA runtime and driver >= 12.8) takes a whole direction's
  coalesced runs in one call; it is called through ctypes on the libcudart torch loaded,
  because torch does not expose it. Its signature changed in CUDA 13 (no `failIdx`), so the
  binding follows `cudaRuntimeGetVersion`. A small self-test decides whether it is used;
  otherwise each run is one `copy_(non_blocking=True)` on the direction's stream.
* `cudaHostRegister` page-locks the host pool in place (an mmap'd, NUMA-bound region, see
  hostmem.py). `pin_memory=True` would allocate a new buffer rounded up to a power of two.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvmem_svc.layout import PoolGeometry, coalesce

log = structlog.get_logger()

_SUCCESS = 0
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current one
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
_BATCH_MIN_VERSION = 12080


class CudaError(RuntimeError):
    pass


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    # struct cudaMemcpyAttributes (driver_types.h, CUDA 12.8 and 13.x alike).
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CudaRuntime:
    """The few libcudart entry points torch does not wrap."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self._lib = lib
        self.path = path
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        self.runtime_version = self._version(lib.cudaRuntimeGetVersion)
        self.driver_version = self._version(lib.cudaDriverGetVersion)
        self._batch = self._bind_batch()

    @staticmethod
    @functools.cache
    def load() -> CudaRuntime | None:
        """The libcudart this process uses (torch's), or None without CUDA."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()  # loads torch's libcudart, so /proc/self/maps can name it
        for name in [*_mapped_cudart(), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
            try:
                return CudaRuntime(ctypes.CDLL(name), name)
            except (OSError, AttributeError):
                continue
        log.warning("cudart_not_found", detail="no batched memcpy, no cudaHostRegister")
        return None

    def _version(self, fn: Any) -> int:
        v = ctypes.c_int(0)
        self.check(fn(ctypes.byref(v)), "get version")
        return v.value

    def check(self, rc: int, what: str) -> None:
        if rc != _SUCCESS:
            msg = self._lib.cudaGetErrorString(rc).decode(errors="replace")
            raise CudaError(f"{what}: CUDA error {rc} ({msg})")

    def pci_bus_id(self, device: int) -> str:
        """'0000:3b:00.0'-style PCI address of CUDA device `device` (sysfs spelling)."""
        buf = ctypes.create_string_buffer(64)
        self.check(self._lib.cudaDeviceGetPCIBusId(buf, len(buf), device), "cudaDeviceGetPCIBusId")
        domain, rest = buf.value.decode().lower().split(":", 1)
        return f"{int(domain, 16):04x}:{rest}"  # NVML-style 8-digit domains exist too

    # -- page-locked host memory ---------------------------------------------------------
    def host_register(self, ptr: int, nbytes: int) -> None:
        self.check(self._lib.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE),
                   f"cudaHostRegister({nbytes} bytes)")

    def host_unregister(self, ptr: int) -> None:
        self.check(self._lib.cudaHostUnregister(ptr), "cudaHostUnregister")

    # -- batched copies -------------------------------------------------------------------
    def _bind_batch(self) -> Any:
        fn = getattr(self._lib, "cudaMemcpyBatchAsync", None)
        if fn is None or min(self.runtime_version, self.driver_version) < _BATCH_MIN_VERSION:
            return None
        args = [
            ctypes.POINTER(ctypes.c_void_p),  # dsts
            ctypes.POINTER(ctypes.c_void_p),  # srcs
            ctypes.POINTER(ctypes.c_size_t),  # sizes
            ctypes.c_size_t,  # count
            ctypes.POINTER(_MemcpyAttributes),  # attrs
            ctypes.POINTER(ctypes.c_size_t),  # attrsIdxs
            ctypes.c_size_t,  # numAttrs
        ]
        if self.runtime_version < 13000:
            args.append(ctypes.POINTER(ctypes.c_size_t))  # failIdx: CUDA 12.8/12.9 only
        args.append(ctypes.c_void_p)  # stream
        fn.argtypes = args
        fn.restype = ctypes.c_int
        return fn

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> None:
        """One call for many independent copies, in stream order on `stream`."""
        if self._batch is None:
            raise CudaError("cudaMemcpyBatchAsync needs CUDA >= 12.8")
        n = len(sizes)
        if n == 0:
            return
        d = (ctypes.c_void_p * n)(*dsts)
        s = (ctypes.c_void_p * n)(*srcs)
        z = (ctypes.c_size_t * n)(*sizes)
        attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)  # no hints, no flags
        first = ctypes.c_size_t(0)  # the one attribute entry applies from copy 0 on
        args: list[object] = [d, s, z, n, ctypes.byref(attrs), ctypes.byref(first), 1]
        fail = ctypes.c_size_t(0)
        if self.runtime_version < 13000:
            args.append(ctypes.byref(fail))
        rc = self._batch(*args, ctypes.c_void_p(stream))
        if rc != _SUCCESS:
            where = f" (copy {fail.value})" if self.runtime_version < 13000 else ""
            self.check(rc, f"cudaMemcpyBatchAsync of {n} copies{where}")


def _mapped_cudart() -> list[str]:
    """Paths of libcudart already mapped into this process (torch's own, if dynamic)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p))


@dataclass(slots=True)
class PendingStep:
    """A step enqueued on a stream; its events time it once the stream gets there."""

    kind: str
    start: torch.cuda.Event
    end: torch.cuda.Event
    copies: int


class CudaCopier:
    """Enqueues a plan's steps on two streams ("d2h", "h2d"); the host thread never copies."""

    def __init__(self, device_pool: torch.Tensor, host_pool: torch.Tensor, geo: PoolGeometry) -> None:
        if host_pool.device.type != "cpu" or not host_pool.is_contiguous():
            raise ValueError("the host pool must be one contiguous CPU tensor")
        if not device_pool.is_contiguous():
            raise ValueError("the device pool must be contiguous")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.geo = geo
        self.device = device_pool.device
        with torch.cuda.device(self.device):
            # High priority: a swap-in gates the next iteration's compute.
            self.streams = {
                "d2h": torch.cuda.Stream(self.device, priority=-1),
                "h2d": torch.cuda.Stream(self.device, priority=-1),
            }
        self.pinned = host_pool.numel() == 0 or host_pool.is_pinned()
        if not self.pinned:
            log.warning("host_pool_not_pinned",
                        detail="device<->pageable copies are synchronous: no duplex overlap")
        self.runtime = CudaRuntime.load()
        self.batched = bool(self.runtime and self.runtime.has_batch and self.pinned
                            and self._batch_self_test())

    def describe(self) -> str:
        how = "cudaMemcpyBatchAsync per direction" if self.batched else "copy_ loop"
        ver = self.runtime.runtime_version if self.runtime else "?"
        return f"cuda {self.device} (runtime {ver}): 2 streams, {how}, host pinned={self.pinned}"

    def enqueue(self, lane: str, steps: list[tuple[str, list[tuple[int, int]], bool]],
                layer_first: bool) -> list[PendingStep]:
        """Enqueue steps (kind, (src, dst) pairs, to_host) in order on the lane's stream."""
        stream = self.streams["h2d" if lane == "h2d" else "d2h"]
        out = []
        with torch.cuda.device(self.device):
            # Copies read/write blocks that compute queued earlier on this process's current
            # stream may still touch: start after it.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for kind, pairs, to_host in steps:
                    src, dst = ((self.device_pool, self.host_pool) if to_host
                                else (self.host_pool, self.device_pool))
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    n = self._copy(stream, src, dst, pairs, layer_first)
                    end.record(stream)
                    out.append(PendingStep(kind, start, end, n))
        return out

    def _copy(self, stream: torch.cuda.Stream, src: torch.Tensor, dst: torch.Tensor,
              pairs: list[tuple[int, int]], layer_first: bool) -> int:
        if layer_first:  # vLLM 0.6: one cudaMemcpyAsync per layer, per K/V, per block
            for layer in range(self.geo.num_layers):
                for kv in range(2):
                    sv, dv = src[:, layer, kv], dst[:, layer, kv]
                    for s, d in pairs:
                        dv[d].copy_(sv[s], non_blocking=True)
            return len(pairs) * self.geo.segments_per_block
        runs = coalesce(pairs)
        if self.batched and self.runtime is not None:
            bb, sp, dp = self.geo.block_bytes, src.data_ptr(), dst.data_ptr()
            self.runtime.memcpy_batch([dp + d * bb for _, d, _ in runs],
                                      [sp + s * bb for s, _, _ in runs],
                                      [n * bb for _, _, n in runs], stream.cuda_stream)
        else:
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        return len(runs)

    def _batch_self_test(self) -> bool:
        """Round-trip a few scattered chunks through the batched call; False disables it."""
        assert self.runtime is not None
        try:
            n, chunk = 4, 4096
            host = torch.arange(n * chunk, dtype=torch.uint8).pin_memory()
            dev = torch.zeros(n * chunk, dtype=torch.uint8, device=self.device)
            back = torch.zeros(n * chunk, dtype=torch.uint8).pin_memory()
            stream = self.streams["h2d"]
            order = [2, 0, 3, 1]
            with torch.cuda.device(self.device):
                self.runtime.memcpy_batch([dev.data_ptr() + i * chunk for i in order],
                                          [host.data_ptr() + i * chunk for i in range(n)],
                                          [chunk] * n, stream.cuda_stream)
                self.runtime.memcpy_batch([back.data_ptr() + i * chunk for i in range(n)],
                                          [dev.data_ptr() + i * chunk for i in order],
                                          [chunk] * n, stream.cuda_stream)
                stream.synchronize()
            if torch.equal(host, back):
                return True
            log.warning("memcpy_batch_self_test", result="wrong bytes; using the copy_ loop")
        except (CudaError, RuntimeError) as e:
            log.warning("memcpy_batch_self_test", result=str(e))
        return False
