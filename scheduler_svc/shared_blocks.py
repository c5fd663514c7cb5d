"""Device blocks owned by more than one request: the prompt blocks n choices share.

Pure Python, one small table beside the block manager's: for each shared device block,
how many owners it has beyond the first. A release drops one owner; only the last owner's
release returns the block to the allocator. Nothing is ever written into a shared block
(only full prompt blocks are shared, scheduler_svc/fork.py), so sharing needs no copy on
write. The prefix-caching work generalises this to blocks shared by prompt content; this
table is what it would replace.
"""

from __future__ import annotations

from collections.abc import Iterable


class SharedBlocks:
    __slots__ = ("_extra",)

    def __init__(self) -> None:
        self._extra: dict[int, int] = {}  # block -> owners beyond the first

    def share(self, blocks: Iterable[int]) -> None:
        """Each block gains one owner."""
        for b in blocks:
            self._extra[b] = self._extra.get(b, 0) + 1

    def drop(self, block: int) -> bool:
        """One owner lets go of `block`; True when others still own it."""
        n = self._extra.get(block, 0)
        if not n:
            return False
        if n == 1:
            del self._extra[block]
        else:
            self._extra[block] = n - 1
        return True

    def unowned(self, blocks: Iterable[int]) -> list[int]:
        """Drop one owner of each block; the blocks nobody owns any more."""
        return [b for b in blocks if not self.drop(b)]

    def owners(self, block: int) -> int:
        """Owners of a block in use (1 unless shared)."""
        return 1 + self._extra.get(block, 0)

    def __len__(self) -> int:
        """Blocks with more than one owner."""
        return len(self._extra)

    def clear(self) -> None:
        self._extra.clear()
