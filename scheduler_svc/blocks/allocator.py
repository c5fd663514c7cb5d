"""One tier's free list of blocks."""

from __future__ import annotations


class BlockAllocator:
    """Free list of one tier's blocks. LIFO so that hot blocks are reused first."""

    __slots__ = ("num_blocks", "_free", "_is_free")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        free = self._free
        if n > len(free):
            raise MemoryError(f"asked for {n} blocks, {len(free)} free")
        keep = len(free) - n
        out = free[keep:][::-1]  # pop()'s order, the last freed first, in one slice
        del free[keep:]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"double free of block {b}")
            self._is_free[b] = True
            self._free.append(b)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]
