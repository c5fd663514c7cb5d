"""Block copies between the device KV pool and the host KV pool (both block-first).

`copy_blocks` is the simple path: one thread, adjacent runs coalesced into one slice copy
each. `LocalCopyEngine` is the in-process transfer engine (`superinfer generate`): it hands
plans to DuplexKV (kvmem_svc/duplex.py), duplex by default.
"""

from __future__ import annotations

import torch

from common.contracts import TransferPlan
from kvmem_svc.duplex import DuplexEngine, Mode, TransferTiming
from kvmem_svc.layout import coalesce

__all__ = ["LocalCopyEngine", "coalesce", "copy_blocks"]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> int:
    """Copy blocks src[s] -> dst[d]; returns the number of copy calls made."""
    runs = coalesce(pairs)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n])
    return len(runs)


class LocalCopyEngine:
    """Transfer engine for one process that holds both pools (`superinfer generate`)."""

    def __init__(self, device_pool: torch.Tensor, host_pool: torch.Tensor,
                 mode: Mode | str = Mode.DUPLEX) -> None:
        if device_pool.shape[1:] != host_pool.shape[1:]:
            raise ValueError("device and host pools must share the block shape")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.engine = DuplexEngine(device_pool, host_pool, mode)

    def transfer(self, plan: TransferPlan) -> TransferTiming:
        """Every copy of the plan is done on return: the caller may complete its fence."""
        return self.engine.transfer(plan)

    def close(self) -> None:
        self.engine.close()
