"""Physical KV blocks with reference counts. Block 0 is the model's null block and never handed out."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Blocks ``1..num_blocks-1`` of the paged KV cache: a free list plus one reference count per block.

    A block is free (on the free list), or held: by in-flight sequences (ref count > 0) and/or by the
    prefix cache (the manager tracks that; such a block keeps ref count 0 while nobody uses it).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._is_free = [False] + [True] * (num_blocks - 1)
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free block with ref count 1, or None when the free list is empty."""
        if not self._free:
            return None
        block = self._free.popleft()
        self._is_free[block] = False
        self._refs[block] = 1
        return block

    def is_free(self, block: int) -> bool:
        """Whether `block` is a pool block (not the null block 0) that nobody holds."""
        return 0 < block < self.num_blocks and self._is_free[block]

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def incref(self, block: int) -> None:
        self._check_held(block)
        self._refs[block] += 1

    def decref(self, block: int) -> int:
        """Drop one reference; returns the new count (the caller decides whether the block is freed)."""
        self._check_held(block)
        if self._refs[block] == 0:
            raise RuntimeError(f"block {block} released more times than it was acquired")
        self._refs[block] -= 1
        return self._refs[block]

    def free(self, block: int) -> None:
        self._check_held(block)
        if self._refs[block] != 0:
            raise RuntimeError(f"block {block} freed while {self._refs[block]} sequence(s) still use it")
        self._is_free[block] = True
        self._free.append(block)

    def _check_held(self, block: int) -> None:
        if not 0 < block < self.num_blocks:
            raise ValueError(f"block {block} is outside the pool 1..{self.num_blocks - 1}")
        if self._is_free[block]:
            raise RuntimeError(f"block {block} is free")
