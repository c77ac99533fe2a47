"""Hybrid prefix caching: attention KV blocks shared by hash, GDN states restored from checkpoints."""

from .block_pool import BlockPool
from .build import build_prefix_cache
from .checkpoint import GDNCheckpoint, GDNStateSpec, layer_checksums
from .config import KERNEL_CHUNK, KVBlocksExhausted, PrefixCacheConfig
from .events import BlocksRemoved, BlocksStored, PrefixCacheEvent
from .hashing import block_key, chain_keys, root_key
from .manager import CachedSequence, PrefixCache

__all__ = [
    "KERNEL_CHUNK",
    "BlockPool",
    "BlocksRemoved",
    "BlocksStored",
    "CachedSequence",
    "GDNCheckpoint",
    "GDNStateSpec",
    "KVBlocksExhausted",
    "PrefixCache",
    "PrefixCacheConfig",
    "PrefixCacheEvent",
    "block_key",
    "build_prefix_cache",
    "chain_keys",
    "layer_checksums",
    "root_key",
]
