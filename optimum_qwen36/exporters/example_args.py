"""Example arguments of each step, of the shapes its callers pass: what the graphs are traced with."""

from __future__ import annotations

import torch

from ..backends.base import no_snapshots, packed_prefill_args
from ..network.cache import CacheStorage
from ..network.neuron_config import Qwen36NeuronConfig


def example_step_args(
    neuron_config: Qwen36NeuronConfig,
    cache: CacheStorage,
    hidden_size: int | None = None,
    packed_prefill: bool = False,
    prefill_snapshots: int = 0,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Arguments of the shapes the callers pass, for tracing each graph (decode_step: the full batch; the
    speculative steps need the model's `hidden_size`; `packed_prefill`: prefill_chunk as packed prefill
    graphs take it)."""
    chunk, batch = neuron_config.prefill_chunk_size, neuron_config.batch_size
    device = cache.key_cache.device

    def scalar(value: int) -> torch.Tensor:
        return torch.tensor(value, device=device)

    prefill = (
        torch.zeros((1, chunk), dtype=torch.long, device=device),
        scalar(0),
        scalar(chunk),
        scalar(0),
        cache.row_block_tables()[0],
        *cache.step_tensors(),
    )
    if packed_prefill:
        prefill = packed_prefill_args(prefill)
    if prefill_snapshots:
        prefill = (*prefill, *no_snapshots(prefill_snapshots, cache.scratch_slot, device))
    decode = (
        torch.zeros((batch, 1), dtype=torch.long, device=device),
        torch.zeros(batch, dtype=torch.long, device=device),
        torch.arange(batch, device=device),
        cache.row_block_tables(),
        *cache.step_tensors(),
    )
    row = (*(a[:1] for a in decode[:4]), *decode[4:])
    examples = {"prefill_chunk": prefill, "decode_row": row, "decode_step": decode}
    if neuron_config.num_speculative_tokens and hidden_size is not None:
        examples.update(_speculative_step_args(neuron_config, cache, hidden_size))
    return examples


def _speculative_step_args(
    neuron_config: Qwen36NeuronConfig, cache: CacheStorage, hidden_size: int
) -> dict[str, tuple[torch.Tensor, ...]]:
    """verify: k + 1 tokens of one row / every row; mtp: a whole chunk of one row / every row."""
    device, batch = cache.key_cache.device, neuron_config.batch_size
    fed = neuron_config.num_speculative_tokens + 1
    tables = cache.row_block_tables()
    chunk = neuron_config.prefill_chunk_size
    verify = (
        torch.zeros((batch, fed), dtype=torch.long, device=device),
        torch.zeros(batch, dtype=torch.long, device=device),
        torch.full((batch,), fed, dtype=torch.long, device=device),
        torch.arange(batch, device=device),
        cache.row_block_tables(),
        *cache.step_tensors(),
        *cache.spec_tensors(),
    )
    mtp = (
        torch.zeros((batch, chunk), dtype=torch.long, device=device),
        torch.zeros((batch, chunk, hidden_size), dtype=cache.key_cache.dtype, device=device),
        torch.zeros(batch, dtype=torch.long, device=device),
        torch.full((batch,), chunk, dtype=torch.long, device=device),
        tables,
        cache.key_cache,
        cache.value_cache,
    )

    def one_row(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (*(a[:1] for a in args[:5]), *args[5:])  # the first five arguments have a row dimension

    return {"verify_row": one_row(verify), "verify_step": verify, "mtp_row": one_row(mtp), "mtp_step": mtp}
