"""The prefix cache's settings, and the error it raises when every KV block is in use."""

from __future__ import annotations

from dataclasses import dataclass

KERNEL_CHUNK = 64  # GDN kernel chunk: chunked prefill is only exact-resumable at multiples of it


class KVBlocksExhausted(RuntimeError):
    """Every KV block is used by in-flight sequences: none is free and none can be evicted."""


@dataclass(frozen=True)
class PrefixCacheConfig:
    """What to cache and how much memory it may use."""

    budget_bytes: int  # KV blocks registered in the cache + GDN checkpoints
    block_size: int = 64
    granularity: int = 64  # checkpoint positions are multiples of this
    checkpoint_interval: int = 2048  # sparse checkpoints inside long prompts; 0 disables
    identity: str = ""  # model/artifact identity salting every hash

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.granularity <= 0 or self.granularity % KERNEL_CHUNK or self.granularity % self.block_size:
            raise ValueError(
                f"granularity must be a positive multiple of the kernel chunk ({KERNEL_CHUNK}) and of "
                f"block_size ({self.block_size}), got {self.granularity}"
            )
        if self.checkpoint_interval < 0 or self.checkpoint_interval % self.granularity:
            raise ValueError(
                f"checkpoint_interval must be 0 or a multiple of granularity ({self.granularity}), "
                f"got {self.checkpoint_interval}"
            )
