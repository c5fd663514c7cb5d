"""The block-first KV layout (DESIGN §2) as byte arithmetic, and coalescing of block runs.

A pool is one tensor `[num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]`:
block b is one contiguous segment of `block_bytes`, and inside it layer l's K (or V) is the
`segment_bytes` piece at `(2 * l + kv) * segment_bytes` — the unit vLLM 0.6's per-layer
caches copied one call at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class PoolGeometry:
    num_layers: int
    block_bytes: int  # all layers, K and V, of one block
    segment_bytes: int  # one layer's K (or V) of one block

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolGeometry:
        if pool.dim() != 6 or pool.shape[2] != 2:
            raise ValueError(
                "a KV pool is [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], "
                f"got shape {list(pool.shape)}"
            )
        seg = pool.shape[3] * pool.shape[4] * pool.shape[5] * pool.element_size()
        return cls(num_layers=pool.shape[1], block_bytes=seg * 2 * pool.shape[1], segment_bytes=seg)

    @property
    def segments_per_block(self) -> int:
        return 2 * self.num_layers


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
