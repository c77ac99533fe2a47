"""What a backend is: the steps of the model, however they were compiled, and the arguments they are
traced with."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..network.cache import CacheStorage
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig


class StepBackend(Protocol):
    """Runs `Qwen36ForCausalLM.prefill_chunk` and `.decode_step` (same arguments, same results).
    `packs_prefill`: whether prefill_chunk takes several sequences packed in one call (else one);
    `decodes_in_prefill`: whether such a call also takes up to batch tokens beyond a chunk, so a step's
    decode rows (one-token sequences) ride along in it; `prefill_snapshots`: how many GDN states inside
    its sequences such a call can write to the cache's snapshot slots (prefix cache checkpoints that then
    need no chunk of their own; keyword arguments `snapshot_ends` / `snapshot_slots` of prefill_chunk)."""

    name: str
    # Where the cache tensors must live (the steps update them in place there).
    device: str
    # Whether decode_step accepts fewer rows than the exported batch (else callers pad to the full batch),
    # and the fewest rows a decode, verify or MTP step takes (callers pad with dummy rows in the scratch
    # slot and the null block).
    decodes_any_batch: bool
    min_step_rows: int
    packs_prefill: bool
    decodes_in_prefill: bool
    prefill_snapshots: int
    # With tensor parallelism, whether each rank compiles graphs of its own (then a saved model holds every
    # rank's: the driver adds the others' `compiled_files()` with `add_compiled_files`), or every rank runs
    # the same graphs, weights bound at load, and rank 0's are all a saved model needs.
    per_rank_graphs: bool

    def prefill_chunk(
        self,
        *args: torch.Tensor,
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def decode_step(self, *args: torch.Tensor) -> torch.Tensor: ...

    # MTP speculative decoding (`Qwen36ForCausalLM.prefill_chunk_hidden`, `.verify_step`, `.mtp_step`) and
    # prompt log-probabilities (`prefill_chunk_hidden`, `position_logits`; the neuron backend has no
    # position_logits: the engine refuses prompt_logprobs there).
    def prefill_chunk_hidden(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def position_logits(self, normed: torch.Tensor) -> torch.Tensor: ...

    def verify_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def mtp_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def save(self, directory: Path) -> None:
        """Write what a saved model needs to run this backend without compiling (under directory)."""

    # Only where per_rank_graphs: what `save` writes, by path in `compiled/`, and writing another rank's.
    def compiled_files(self) -> dict[str, bytes]: ...

    def add_compiled_files(self, directory: Path, files: dict[str, bytes]) -> None: ...


# The fewest tokens a prefill graph takes, block-table columns a step passes, rows a batched step takes and
# sequences a packed prefill graph takes: Inductor compiles dynamic sizes for 2 and up (`regions._dims`), so
# a one-token chunk runs padded to 2 tokens, a one-block table passes a second (masked-out) column, one row
# decodes padded to two, and one sequence prefills beside an empty one (`packed_prefill_args`).
MIN_PREFILL_TOKENS = 2
MIN_TABLE_BLOCKS = 2
MIN_BATCH_ROWS = 2
MIN_PACKED_SEQUENCES = 2
# The GDN state snapshots one packed prefill call takes (a chunk that crosses a prompt's end checkpoint and
# its chat history's, say), and so the cache's snapshot slots.
PREFILL_SNAPSHOTS = 2


def blocks_in_use(
    method: str, args: tuple[torch.Tensor, ...], cut_tokens: bool = True
) -> tuple[torch.Tensor, ...]:
    """`args` of a step cut to what it uses, for backends whose steps take any table width: block table(s)
    cut to the blocks holding this step's positions (attention then reads the context so far, not all of
    the compiled sequence_length; the masked-out blocks would add nothing), and, with `cut_tokens` (the
    prefill graphs take any number of tokens), a prefill chunk's tokens cut to its valid ones (a short
    prompt or a prompt's last chunk does not pay for a whole padded chunk; padded tokens change nothing)."""
    block_size = args[-4].shape[2]  # key_cache [attention layers, blocks, block_size, heads, head_dim]
    if method == "prefill_chunk":
        input_ids, start_pos, num_valid, slots, block_tables, *caches = args
        end = int((start_pos + num_valid).max())
        used = table_width(-(-end // block_size), block_tables.shape[-1])
        total = max(int(num_valid.sum()), MIN_PREFILL_TOKENS)
        tokens = input_ids[:, :total] if cut_tokens else input_ids
        return (tokens, start_pos, num_valid, slots, block_tables[..., :used].contiguous(), *caches)
    input_ids, positions, slots, block_tables, *caches = args
    used = table_width(int(positions.max()) // block_size + 1, block_tables.shape[1])
    return (input_ids, positions, slots, block_tables[:, :used].contiguous(), *caches)


def packed_prefill_args(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A prefill call (cut to its tokens: `blocks_in_use`) as packed prefill graphs take it: per-sequence
    [S] arguments and [S, width] tables, with an empty sequence added where there is one only (or padding
    tokens for a call of one token) in the cache's scratch slot and the null block, whose results nobody
    reads."""
    input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state, state = args
    start_pos, num_valid, slots = start_pos.reshape(-1), num_valid.reshape(-1), slots.reshape(-1)
    block_tables = block_tables.reshape(len(slots), -1)
    total = int(num_valid.sum())
    if len(slots) < MIN_PACKED_SEQUENCES or total < MIN_PREFILL_TOKENS:
        padding = max(0, MIN_PREFILL_TOKENS - total)
        input_ids = torch.nn.functional.pad(input_ids[:, :total], (0, padding))
        start_pos = torch.cat([start_pos, start_pos.new_zeros(1)])
        num_valid = torch.cat([num_valid, num_valid.new_full((1,), padding)])
        slots = torch.cat([slots, slots.new_full((1,), conv_state.shape[1] - 1)])
        block_tables = torch.cat([block_tables, block_tables.new_zeros((1, block_tables.shape[1]))])
    return (input_ids, start_pos, num_valid, slots, block_tables, key_cache, value_cache, conv_state, state)


def no_snapshots(
    count: int, scratch_slot: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` snapshot entries that snapshot nothing (`snapshot_ends`, `snapshot_slots` of a packed prefill):
    an end of 0 lies inside no sequence, and their conv rows go to the scratch slot."""
    ends = torch.zeros(count, dtype=torch.long, device=device)
    return ends, torch.full((count,), scratch_slot, dtype=torch.long, device=device)


def rows_blocks_in_use(
    start_pos: torch.Tensor, num_valid: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The block tables [B, max_blocks] of a step of several tokens per row, cut to the blocks holding its
    positions (see `blocks_in_use`)."""
    used = -(-int((start_pos + num_valid).max()) // block_size)
    return block_tables[:, : table_width(used, block_tables.shape[1])].contiguous()


def table_width(used: int, width: int) -> int:
    """How many of a block table's `width` columns a step passes when `used` hold its positions: at least
    MIN_TABLE_BLOCKS (the compiled graphs' dynamic width starts there; the extra block is masked out)."""
    return min(width, max(used, MIN_TABLE_BLOCKS))


class EagerBackend:
    """The reference backend: the model's own PyTorch code, uncompiled."""

    name = "eager"
    decodes_any_batch = True
    min_step_rows = 1
    packs_prefill = True
    decodes_in_prefill = True
    prefill_snapshots = PREFILL_SNAPSHOTS
    per_rank_graphs = False  # no graphs

    def __init__(self, model: Qwen36ForCausalLM) -> None:
        self.model = model
        self.device = str(next(model.parameters()).device)

    @torch.no_grad()
    def prefill_chunk(
        self,
        *args: torch.Tensor,
        snapshot_ends: torch.Tensor | None = None,
        snapshot_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        used = blocks_in_use("prefill_chunk", args)
        return self.model.prefill_chunk(*used, snapshot_ends, snapshot_slots)

    @torch.no_grad()
    def decode_step(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model.decode_step(*blocks_in_use("decode_step", args))

    @torch.no_grad()
    def prefill_chunk_hidden(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.prefill_chunk_hidden(*blocks_in_use("prefill_chunk", args))

    @torch.no_grad()
    def position_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.position_logits(normed)

    @torch.no_grad()
    def verify_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, start_pos, num_valid, slots, block_tables, key_cache, *states = args
        tables = rows_blocks_in_use(start_pos, num_valid, block_tables, key_cache.shape[2])
        return self.model.verify_step(input_ids, start_pos, num_valid, slots, tables, key_cache, *states)

    @torch.no_grad()
    def mtp_step(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, hidden, start_pos, num_valid, block_tables, key_cache, value_cache = args
        tables = rows_blocks_in_use(start_pos, num_valid, block_tables, key_cache.shape[2])
        return self.model.mtp_step(input_ids, hidden, start_pos, num_valid, tables, key_cache, value_cache)

    def save(self, directory: Path) -> None:
        """Nothing compiled: the weights and settings the model saves are all it needs."""


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
