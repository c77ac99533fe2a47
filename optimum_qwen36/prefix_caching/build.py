"""The prefix cache of a model's cache: sized and salted from the export settings."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from .checkpoint import GDNStateSpec
from .config import PrefixCacheConfig
from .manager import PrefixCache

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..network.cache import CacheStorage
    from ..network.neuron_config import Qwen36NeuronConfig


def build_prefix_cache(
    kv: CacheStorage, neuron_config: Qwen36NeuronConfig, model_config: PretrainedConfig
) -> PrefixCache:
    """A prefix cache managing every block of ``kv`` (block 0 excepted) and checkpointing its GDN slots."""
    spec = GDNStateSpec(
        num_layers=kv.conv_state.shape[0],
        conv_shape=tuple(kv.conv_state.shape[2:]),
        conv_dtype=kv.conv_state.dtype,
        recurrent_shape=tuple(kv.recurrent_state.shape[2:]),
        recurrent_dtype=kv.recurrent_state.dtype,
    )
    # K and V of one block across every attention layer.
    kv_bytes = 2 * kv.key_cache[:, 0].numel() * kv.key_cache.element_size()
    # States depend on the weights, their dtype and the backend's numerics: salt every key with them.
    identity = "|".join(
        (
            str(neuron_config.checkpoint_id),
            str(neuron_config.checkpoint_revision),
            neuron_config.dtype,
            neuron_config.backend,
            model_config.to_json_string(),
        )
    )
    config = PrefixCacheConfig(
        budget_bytes=neuron_config.prefix_cache_bytes,
        block_size=kv.block_size,
        granularity=neuron_config.prefix_cache_granularity,
        checkpoint_interval=neuron_config.prefix_cache_interval,
        identity=hashlib.sha256(identity.encode()).hexdigest(),
    )
    return PrefixCache(config, num_blocks=kv.key_cache.shape[1], kv_bytes_per_block=kv_bytes, state_spec=spec)
