"""What the prefix cache tells the world about the prefixes it can reuse (for routers that send a request
to the replica holding its prefix). A block is announced stored once a GDN checkpoint at or after it
exists on its path: only then can a prefix through it be reused, since a hybrid model resumes from the
attention KV *and* the GDN state at the same position. It is announced removed when evicted. Hashes are
the first 8 bytes of the chain keys, as unsigned integers (vLLM's integer block hashes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlocksStored:
    block_hashes: tuple[int, ...]  # root to leaf
    parent_block_hash: int | None  # the block before the first (None: they start the prompt)
    token_ids: tuple[int, ...]  # every block's tokens, in order


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


PrefixCacheEvent = BlocksStored | BlocksRemoved


def block_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")
