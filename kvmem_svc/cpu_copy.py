"""Block copies between two KV pools in host DRAM: DuplexKV's CPU "copy engine".

On a CPU both pools are DRAM (DESIGN §1), so a transfer is a memory copy. Contiguous pools
are copied with libc `memmove` through ctypes: the call releases the GIL (the two direction
threads really run at once) and stays on its own thread. `Tensor.copy_` splits each copy of
a few MiB over an OpenMP team instead: on an idle 2-core machine that made one 4 MiB block
copy ~1.2x faster than memmove, but with the cores busy (load ~8 here) every call waited for
both OpenMP threads to be scheduled and block copies fell to 0.2-0.3 GB/s, and two direction
threads each starting a team oversubscribe the cores. Anything memmove cannot address (a
strided view) falls back to `copy_`.

glibc switches `memmove` to non-temporal stores only above
`glibc.cpu.x86_non_temporal_threshold` (~114 MiB here), so one huge copy writes ~1.5x
faster than the same bytes in 4 MiB blocks; a process that mostly moves KV blocks (the
kvmem daemon) should lower it, as it does (kvmem_svc/tunables.py).
"""

from __future__ import annotations

import ctypes

import torch

from kvmem_svc.layout import PoolGeometry

_memmove = ctypes.memmove  # a CFUNCTYPE: the call releases the GIL


def memmove_ok(*pools: torch.Tensor) -> bool:
    """Can blocks of every pool be addressed as `data_ptr() + i * block_bytes`?"""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in pools)


def copy_runs(
    src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]], geo: PoolGeometry,
    use_memmove: bool,
) -> int:
    """Block-first: one copy per coalesced run (src_start, dst_start, n). Returns copies made.

    Block ids must already be checked against both pools: `memmove` has no bounds.
    """
    if use_memmove:
        sp, dp, bb = src.data_ptr(), dst.data_ptr(), geo.block_bytes
        for s, d, n in runs:
            _memmove(dp + d * bb, sp + s * bb, n * bb)
    else:
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n])
    return len(runs)


def copy_segments(
    src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]], geo: PoolGeometry,
    use_memmove: bool,
) -> int:
    """Layer-first baseline (vLLM 0.6): per layer, per K/V, per block, one segment copy.

    The same bytes as `copy_runs`, in `2 * num_layers` small copies per block, visited in
    the order a per-layer cache forces: all blocks of layer 0's K, then of layer 0's V, ...
    """
    if use_memmove:
        sp, dp = src.data_ptr(), dst.data_ptr()
        bb, seg = geo.block_bytes, geo.segment_bytes
        for k in range(geo.segments_per_block):  # k = 2 * layer + (0 for K, 1 for V)
            off = k * seg
            for s, d in pairs:
                _memmove(dp + d * bb + off, sp + s * bb + off, seg)
    else:
        for layer in range(geo.num_layers):
            for kv in range(2):
                sv, dv = src[:, layer, kv], dst[:, layer, kv]
                for s, d in pairs:
                    dv[d].copy_(sv[s])
    return len(pairs) * geo.segments_per_block
