"""The tensor-parallel sharding plan: which slice of each checkpoint tensor a rank holds (as vLLM shards
Gated DeltaNet), the per-rank model config, and the all-reduces that join the ranks' partial sums.

A rank's model is the ordinary `Qwen36ForCausalLM` built from `shard_config(config, degree)` (fewer heads
and a narrower MLP, the same hidden size), so the model code knows nothing of TP. What changes:

- GDN: `in_proj_qkv` and the depthwise `conv1d` keep the rank's key heads of the q and k sections and its
  value heads of the v section; `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias` its value heads
  (value head j reads key head j // (HV / H), on the same rank); the gated norm is per head (replicated);
  `out_proj` keeps the rank's input columns. Conv and recurrent states hold the rank's heads only.
- Attention: the rank's query heads of the interleaved query / gate `q_proj`, its KV heads (one replicated
  KV head when there are fewer KV heads than ranks), the matching input columns of `o_proj`.
- MLP: gate / up rows, down columns. Norms and the MTP layer's `fc` are replicated.
- FP8 weights split like the weights they replace; a rank's `weight_scale_inv` holds the scales of its
  slice's blocks (`shard_scale`), which must each lie inside one block of the whole weight.
- Embeddings and `lm_head` are vocab-parallel (rank r holds tokens [r P, (r + 1) P), P = ceil(V / N)): the
  embedding and the output projection are most of the bytes a decode step reads on a small model, and
  replicating them would make every rank read all of them. As vLLM's `VocabParallelEmbedding` does, a
  vocabulary the degree does not divide (a fine-tuned checkpoint's added tokens) is padded: the last ranks'
  rows past V are zero, and the gathered logits are cut back to V, so a padding token is never sampled.
- `parallelize` (gpt-fast's module surgery) adds the collectives: the outputs of `o_proj`, `out_proj` and
  `down_proj` are partial sums, summed over the ranks (a forward hook on each); the embedding gives zeros
  for other ranks' tokens and is summed the same way; the lm_head's logits are gathered (and cut to V).
  Every rank then holds the same hidden state after each mixer and MLP, and the same logits. The
  collectives are torch.distributed's functional ones, so the same model code runs eagerly and exports
  into compiled graphs (AOTInductor compiles them to calls of the process group registered as
  `GROUP_NAME`).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import (
    FakeProcessGroup,
    ProcessGroup,
    _register_process_group,
    _unregister_process_group,
)
from transformers import PretrainedConfig

# Modules whose output is a partial sum over the ranks (row-parallel linears).
ROW_PARALLEL = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj")
VOCAB_PARALLEL = ("model.embed_tokens", "lm_head")

# The process group name the collectives are called by. Compiled graphs hold it (AOTInductor writes the
# name into the generated code), so it is one constant: whoever runs a rank's model binds it to that rank's
# process group (distributed/group.py) before the model runs.
GROUP_NAME = "optimum_qwen36_tp"


class TensorParallelError(ValueError):
    """A tensor-parallel degree this model cannot be split by, or settings TP does not support."""


def check_tp_degree(config: PretrainedConfig, degree: int) -> None:
    """Raise unless every sharded count of the model divides by `degree` (KV heads: or divide it; the
    vocabulary is padded instead)."""
    problem = _degree_problem(config, degree)
    if problem is not None:
        raise TensorParallelError(f"{problem} Choose a degree among {valid_degrees(config)}.")


def _degree_problem(config: PretrainedConfig, degree: int) -> str | None:
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, count in counts.items():
        if count % degree:
            return (
                f"tp_degree={degree} does not divide {name}={count}: every rank must hold the same number "
                "of them."
            )
    kv = config.num_key_value_heads
    if kv % degree and degree % kv:
        return (
            f"tp_degree={degree} neither divides num_key_value_heads={kv} (KV heads split over the ranks) "
            "nor is a multiple of it (KV heads replicated)."
        )
    return None


def valid_degrees(config: PretrainedConfig, limit: int = 64) -> list[int]:
    """The tensor-parallel degrees up to `limit` this model can be split by."""
    return [degree for degree in range(1, limit + 1) if _degree_problem(config, degree) is None]


def vocab_rows_per_rank(vocab_size: int, degree: int) -> int:
    """How many rows of the embedding and the lm_head each rank holds: ceil(V / N)."""
    return -(-vocab_size // degree)


def shard_config(config: PretrainedConfig, degree: int) -> PretrainedConfig:
    """The config of one rank's model: its share of every head count, of the MLP width and of the
    (padded) vocabulary, and in `gathered_vocab_size` the whole vocabulary its gathered logits cover."""
    local = copy.deepcopy(config)
    if degree == 1:
        return local
    local.head_dim = config.head_dim
    local.num_attention_heads = config.num_attention_heads // degree
    local.num_key_value_heads = max(1, config.num_key_value_heads // degree)
    local.linear_num_key_heads = config.linear_num_key_heads // degree
    local.linear_num_value_heads = config.linear_num_value_heads // degree
    local.intermediate_size = config.intermediate_size // degree
    local.vocab_size = vocab_rows_per_rank(config.vocab_size, degree)
    local.gathered_vocab_size = config.vocab_size
    return local


def _rows(tensor: torch.Tensor, rank: int, degree: int, dim: int = 0) -> torch.Tensor:
    return tensor.chunk(degree, dim=dim)[rank]


def _vocab_rows(tensor: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    """Rank `rank`'s rows of a vocab-parallel tensor [V, ...]: tokens [r P, (r + 1) P), P = ceil(V / N), the
    rows past V zero."""
    per_rank = vocab_rows_per_rank(tensor.shape[0], degree)
    rows = tensor[rank * per_rank : (rank + 1) * per_rank]
    padding = per_rank - rows.shape[0]
    return torch.cat((rows, rows.new_zeros(padding, *rows.shape[1:]))) if padding else rows


def _qkv_sections(config: PretrainedConfig, tensor: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    """The rank's slices of the q, k and v sections (dim 0) of in_proj_qkv / conv1d, concatenated."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    sections = tensor.split([key_dim, key_dim, value_dim], dim=0)
    return torch.cat([_rows(section, rank, degree) for section in sections], dim=0)


def _kv_heads(config: PretrainedConfig, tensor: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
    """k_proj / v_proj rows of the rank's KV heads: a share of them, or the one its query heads read."""
    kv = config.num_key_value_heads
    if kv >= degree:
        return _rows(tensor, rank, degree)
    return tensor.chunk(kv, dim=0)[rank // (degree // kv)]


def _vocab_parallel(name: str) -> bool:
    return name.rpartition(".")[0] in VOCAB_PARALLEL


def split_kind(name: str) -> str:
    """How the checkpoint tensor `name` is split: "qkv", "rows" (the vocab-parallel tensors: padded to
    ceil(V / N) rows a rank), "kv", "columns", "bias" (row-parallel bias: rank 0 adds it) or
    "replicated"."""
    module, _, kind = name.rpartition(".")
    if re.search(r"linear_attn\.(in_proj_qkv|conv1d)$", module):
        return "qkv"
    if re.search(r"linear_attn\.(in_proj_z|in_proj_a|in_proj_b)$", module) or (
        module.endswith("linear_attn") and kind in ("A_log", "dt_bias")
    ):
        return "rows"  # by value head
    if re.search(r"(self_attn\.q_proj|mlp\.gate_proj|mlp\.up_proj)$", module) or module in VOCAB_PARALLEL:
        return "rows"
    if re.search(r"self_attn\.(k_proj|v_proj)$", module):
        return "kv"
    if module.endswith(ROW_PARALLEL):
        return "bias" if kind == "bias" else "columns"
    return "replicated"  # norms, the MTP layer's fc


def sharding_plan(names: Iterable[str]) -> dict[str, str]:
    """How each of these tensors is split over the ranks (`split_kind`): what a saved artifact records."""
    return {name: split_kind(name) for name in names}


def check_sharding_plan(plan: dict[str, str] | None) -> None:
    """Refuse a saved tensor-parallel model whose recorded plan is not this version's: its graphs were
    compiled for other local shapes."""
    if plan is None:
        raise TensorParallelError(
            "This tensor-parallel model was saved without its sharding plan: re-export it "
            "(from_pretrained(checkpoint, export=True, tp_degree=...))."
        )
    changed = [name for name, split in plan.items() if split_kind(name) != split]
    if changed:
        raise TensorParallelError(
            f"This tensor-parallel model was saved with another sharding plan ({changed[0]}: split as "
            f"{plan[changed[0]]!r}, this version splits it as {split_kind(changed[0])!r}): its graphs were "
            "compiled for other shapes. Re-export it (from_pretrained(checkpoint, export=True, ...))."
        )


def shard_tensor(
    config: PretrainedConfig, name: str, tensor: torch.Tensor, rank: int, degree: int
) -> torch.Tensor:
    """The slice of the checkpoint tensor `name` (a model parameter name) that rank `rank` holds."""
    split = split_kind(name)
    if degree == 1 or split == "replicated":
        return tensor
    if split == "qkv":
        return _qkv_sections(config, tensor, rank, degree)
    if split == "rows":
        return _vocab_rows(tensor, rank, degree) if _vocab_parallel(name) else _rows(tensor, rank, degree)
    if split == "kv":
        return _kv_heads(config, tensor, rank, degree)
    if split == "bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    return _rows(tensor, rank, degree, dim=1)


def unshard_tensor(
    config: PretrainedConfig, name: str, shards: list[torch.Tensor], degree: int
) -> torch.Tensor:
    """The checkpoint tensor `name` joined from every rank's slice (`shards[r]`: rank r's), inverting
    `shard_tensor`."""
    split = split_kind(name)
    if degree == 1 or split in ("replicated", "bias"):
        return shards[0]
    if split == "rows":
        joined = torch.cat(shards, dim=0)
        return joined[: config.vocab_size] if _vocab_parallel(name) else joined
    if split == "columns":
        return torch.cat(shards, dim=1)
    if split == "kv":
        kv = config.num_key_value_heads
        # Fewer KV heads than ranks: ranks r * (degree / kv) hold head r (the others hold copies).
        return torch.cat(shards if kv >= degree else shards[:: degree // kv], dim=0)
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim // degree
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim // degree
    sections = [shard.split([key_dim, key_dim, value_dim], dim=0) for shard in shards]
    return torch.cat([torch.cat([s[i] for s in sections], dim=0) for i in range(3)], dim=0)


SPLIT_DIMS = {"qkv": 0, "rows": 0, "kv": 0, "columns": 1}


def _global_indices(
    config: PretrainedConfig, weight_name: str, size: int, dim: int, rank: int, degree: int
) -> torch.Tensor:
    """Which of the weight's `size` rows (dim 0) or columns (dim 1) rank `rank` holds, in its local order."""
    if SPLIT_DIMS.get(split_kind(weight_name)) != dim:
        return torch.arange(size)
    index = torch.arange(size).reshape((size, 1) if dim == 0 else (1, size))
    return shard_tensor(config, weight_name, index, rank, degree).flatten()


def scale_blocks(
    config: PretrainedConfig,
    weight_name: str,
    weight_shape: tuple[int, int],
    block_size: tuple[int, int],
    rank: int,
    degree: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global scale rows and columns of rank `rank`'s slice of a block-scaled FP8 weight, one per block
    of its local weight. A local block must lie inside one global block (same scale) for the rank's weight
    to dequantize to its slice of the whole; raise TensorParallelError where the split cuts across."""
    blocks = []
    for dim, (size, block) in enumerate(zip(weight_shape, block_size, strict=True)):
        index = _global_indices(config, weight_name, size, dim, rank, degree)
        first_of_block = index[torch.arange(len(index)) // block * block]
        if not torch.equal(index // block, first_of_block // block):
            module = weight_name.removesuffix(".weight")
            what = ("rows", "columns")[dim]
            raise TensorParallelError(
                f"tp_degree={degree} cuts through the FP8 scale blocks of {module}: its {size} {what} are "
                f"scaled in blocks of {block} ({list(block_size)} blocks), and rank {rank}'s share of them "
                "would need two scales in one of its blocks."
            )
        blocks.append(index[::block] // block)
    return blocks[0], blocks[1]


def shard_scale(
    config: PretrainedConfig,
    weight_name: str,
    scale: torch.Tensor,
    weight_shape: tuple[int, int],
    block_size: tuple[int, int],
    rank: int,
    degree: int,
) -> torch.Tensor:
    """The `weight_scale_inv` of rank `rank`'s slice of the FP8 weight `weight_name` (whole: weight_shape),
    so that the rank's weight and scale dequantize to exactly its slice of the whole weight."""
    rows, cols = scale_blocks(config, weight_name, weight_shape, block_size, rank, degree)
    return scale[rows][:, cols]


def unshard_scale(
    config: PretrainedConfig,
    weight_name: str,
    shards: list[torch.Tensor],
    weight_shape: tuple[int, int],
    block_size: tuple[int, int],
) -> torch.Tensor:
    """The whole weight's `weight_scale_inv` joined from every rank's (`shards[r]`: rank r's)."""
    degree = len(shards)
    blocks = [-(-size // block) for size, block in zip(weight_shape, block_size, strict=True)]
    scale = shards[0].new_empty(blocks)
    for rank, shard in enumerate(shards):
        rows, cols = scale_blocks(config, weight_name, weight_shape, block_size, rank, degree)
        scale[rows[:, None], cols] = shard
    return scale


def named_process_group(
    backend: Any, store: Any, rank: int, degree: int, name: str = GROUP_NAME
) -> ProcessGroup:
    """A ProcessGroup called `name` running `backend` (gloo's, or a stand-in) on cpu tensors: what
    torch.distributed's registry of named groups holds."""
    group = ProcessGroup(store, rank, degree)
    gloo = isinstance(backend, dist.ProcessGroupGloo)
    kind = ProcessGroup.BackendType.GLOO if gloo else ProcessGroup.BackendType.CUSTOM
    group._set_default_backend(kind)
    group._register_backend(torch.device("cpu"), kind, backend)
    group._set_group_name(name)
    return group


def bind_group(group: ProcessGroup, name: str = GROUP_NAME) -> None:
    """Register `group` under `name` (in this process), in place of whatever was."""
    with contextlib.suppress(RuntimeError):  # nothing registered yet, or a group since destroyed
        if dist.distributed_c10d._resolve_process_group(name) is group:
            return
    with contextlib.suppress(RuntimeError):
        _unregister_process_group(name)
    _register_process_group(name, group)


@contextlib.contextmanager
def stand_in_group(rank: int, degree: int, name: str = GROUP_NAME) -> Iterator[None]:
    """Register torch's FakeProcessGroup of this rank and degree under `name` while a rank's graphs are
    traced and compiled, before the ranks connect: Inductor asks the group for its size, and the collectives
    of the example inputs (whose values are not used) return at once."""
    fake = FakeProcessGroup._create_internal(rank, degree, FakeProcessGroup.Options())
    group = named_process_group(fake, dist.HashStore(), rank, degree, name)
    bind_group(group, name)
    try:
        yield
    finally:
        _unregister_process_group(name)


class FunctionalCollectives:
    """torch.distributed's functional collectives over the group registered as `group_name`: plain ops
    (`_c10d_functional.all_reduce` / `all_gather_into_tensor`, then `wait_tensor`) that run eagerly and that
    `torch.export` traces into a graph, so compiled graphs run them at the same points as eager code."""

    def __init__(self, degree: int, group_name: str = GROUP_NAME) -> None:
        self.degree = degree
        self.group_name = group_name

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks (every rank gets the same bits)."""
        ops = torch.ops._c10d_functional
        return ops.wait_tensor(ops.all_reduce(tensor, "sum", self.group_name))

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on each) concatenated along the last dimension, in rank order."""
        ops = torch.ops._c10d_functional
        gathered = ops.all_gather_into_tensor(tensor.contiguous(), self.degree, self.group_name)
        stacked = ops.wait_tensor(gathered)
        ranks_last = stacked.view(self.degree, *tensor.shape).movedim(0, -2)
        return ranks_last.reshape(*tensor.shape[:-1], self.degree * tensor.shape[-1])


class VocabParallelEmbedding(nn.Module):
    """One rank's rows of the embedding table, `weight` [ceil(V / N), hidden] for tokens start..: other
    ranks' tokens embed as zeros, and the sum over the ranks is every token's row (x + 0 is exact)."""

    def __init__(self, weight: nn.Parameter, start: int, collectives: FunctionalCollectives) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.collectives = collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        embeds = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.collectives.all_reduce(embeds * mine.unsqueeze(-1).to(embeds.dtype))


class VocabParallelLMHead(nn.Module):
    """One rank's rows of the output projection, `weight` [ceil(V / N), hidden]; the ranks' logits are
    gathered and cut to the `vocab_size` tokens (the padding rows' logits dropped)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, collectives: FunctionalCollectives) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.collectives = collectives

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.collectives.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]


def parallelize(model: nn.Module, rank: int, collectives: FunctionalCollectives) -> None:
    """Add the collectives to one rank's model (built from `shard_config`, holding its shards)."""

    def reduce_output(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(output)

    for name, module in model.named_modules():
        if name.endswith(ROW_PARALLEL):
            module.register_forward_hook(reduce_output)
    embedding = model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(embedding, rank * embedding.shape[0], collectives)
    vocab_size = model.config.gathered_vocab_size
    # The same Parameter as the embedding's when tied.
    model.lm_head = VocabParallelLMHead(model.lm_head.weight, vocab_size, collectives)
