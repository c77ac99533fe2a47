"""What a backend is: the steps of the model, however they were compiled, and how a step's arguments are
cut to what its graphs take (every backend and the engine use these)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..network.vision import ImageInput, Qwen36VisionModel

# Where a saved model keeps what its backend compiled (`StepBackend.save`): <model directory>/compiled/.
COMPILED_DIR = "compiled"


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
    # Whether prefill_chunk(_hidden) takes the keyword arguments of prompts with images (`rope_positions`,
    # `vision_embeds`, `vision_mask`) and decode_step `rope_positions` (network/model.py).
    takes_images: bool

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


class ImageEncoder:
    """Runs the vision tower: an image's features, one per placeholder token the prompt holds for it.
    `placeholder_ids`: the image and video pad tokens the features stand in for."""

    def __init__(
        self, tower: Qwen36VisionModel, placeholder_ids: tuple[int, ...], spatial_merge_size: int
    ) -> None:
        self.tower = tower
        self.placeholder_ids = placeholder_ids
        self.spatial_merge_size = spatial_merge_size

    @torch.no_grad()
    def encode(self, image: ImageInput) -> torch.Tensor:
        """The image's features [image tokens, hidden], in the tower's dtype."""
        return self.tower.encode(image)

    def no_features(self, tokens: int) -> torch.Tensor:
        """Features [tokens, hidden] of no image (zeros, for tokens that are text)."""
        out = self.tower.merger.linear_fc2
        return torch.zeros((tokens, out.out_features), dtype=out.weight.dtype)


# The fewest tokens a prefill graph takes, block-table columns a step passes, rows a batched step takes and
# sequences a packed prefill graph takes: Inductor compiles dynamic sizes for 2 and up
# (`exporters/regions._dims`), so a one-token chunk runs padded to 2 tokens, a one-block table passes a
# second (masked-out) column, one row decodes padded to two, and one sequence prefills beside an empty one
# (`packed_prefill_args`).
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


def fit_chunk_images(images: dict[str, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    """A prefill call's image arguments (`rope_positions` [3, 1, C], `vision_embeds` [1, C, hidden],
    `vision_mask` [1, C]) for its tokens cut or padded to `tokens` (`blocks_in_use`,
    `packed_prefill_args`): padding tokens are text at rotary position 0, never read."""
    fitted = {}
    for name, tensor in images.items():
        axis = 1 if name == "vision_embeds" else tensor.dim() - 1
        missing = tokens - tensor.shape[axis]
        if missing <= 0:
            fitted[name] = tensor.narrow(axis, 0, tokens)
        else:
            padding = list(tensor.shape)
            padding[axis] = missing
            fitted[name] = torch.cat([tensor, tensor.new_zeros(padding)], dim=axis)
    return fitted


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
