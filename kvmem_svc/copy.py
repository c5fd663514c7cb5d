"""Block copies between the device KV pool and the host KV pool (both block-first).

This is the simple, correct path: one thread, adjacent runs coalesced into one slice copy
each. The duplex engine (two directions at once) builds on `coalesce`.
"""

from __future__ import annotations

import torch

from scheduler_svc.block_manager import TransferPlan


def coalesce(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs -> (src_start, dst_start, length) runs, in source order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in sorted(pairs):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> int:
    """Copy blocks src[s] -> dst[d]; returns the number of copy calls made."""
    runs = coalesce(pairs)
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n])
    return len(runs)


class LocalCopyEngine:
    """Transfer engine for one process that holds both pools (`superinfer generate`)."""

    def __init__(self, device_pool: torch.Tensor, host_pool: torch.Tensor) -> None:
        if device_pool.shape[1:] != host_pool.shape[1:]:
            raise ValueError("device and host pools must share the block shape")
        self.device_pool = device_pool
        self.host_pool = host_pool

    def transfer(self, plan: TransferPlan) -> None:
        # D2H first: a swap-in never targets a block an outgoing copy still reads (fences),
        # so the order is for clarity, not correctness.
        copy_blocks(self.device_pool, self.host_pool, plan.swap_out + plan.eager)
        copy_blocks(self.host_pool, self.device_pool, [(h, d) for h, d in plan.swap_in])
