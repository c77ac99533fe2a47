"""The Qwen3.5/3.6 vision tower, the images a prompt carries, and the multimodal RoPE positions of its tokens.

The tower (`model.visual.*` of `Qwen3_5ForConditionalGeneration` checkpoints; names as transformers'
`modeling_qwen3_5.py`) turns an image's patches (what transformers' Qwen2-VL image processor emits:
[t * h * w, channels * temporal_patch * patch * patch] per image, grid (t, h, w)) into one feature per
2 x 2 merged patch, in the language model's hidden size. Those features replace the image's placeholder
tokens (`image_token_id`, t * h * w / 4 of them) in the prompt.

Multimodal RoPE: every token has three rotary positions (temporal, height, width). A text token's are all
its index in the sequence shifted by the extent the images before it saved; an image's tokens stand on
their (t, h, w) grid from where the image starts. The rotary frequencies are split among the three
interleaved (`mrope_section`); for text the three are equal and the rotation is ordinary 1-D RoPE.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

VISION_PREFIX = "model.visual."


@dataclass(frozen=True)
class ImageInput:
    """One image (or video) of a prompt, as the processor gives it: its patches `pixel_values` [t * h * w,
    patch_dim] and grid (t, h, w) in patches. `content_hash` identifies it (its pixels and grid): the prefix
    cache keys the image's tokens with it, so two images behind the same placeholder tokens never share
    computed state."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    content_hash: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        t, h, w = (int(v) for v in self.grid_thw)
        object.__setattr__(self, "grid_thw", (t, h, w))
        if self.pixel_values.ndim != 2 or self.pixel_values.shape[0] != t * h * w:
            raise ValueError(
                f"an image of grid (t, h, w) {self.grid_thw} has {t * h * w} patches, but its pixel_values "
                f"have shape {tuple(self.pixel_values.shape)} (expected [{t * h * w}, patch_dim])."
            )
        if not self.content_hash:
            digest = hashlib.sha256(repr(self.grid_thw).encode())
            digest.update(self.pixel_values.detach().contiguous().cpu().float().numpy().tobytes())
            object.__setattr__(self, "content_hash", digest.hexdigest())

    def num_tokens(self, spatial_merge_size: int) -> int:
        """How many placeholder tokens stand for it in the prompt (one per merged patch)."""
        t, h, w = self.grid_thw
        return t * h * w // spatial_merge_size**2

    def cache_key_token(self) -> int:
        """What stands for each of its placeholder tokens in the prefix cache's keys: negative, so never a
        vocabulary id, and from its content."""
        return -1 - int(self.content_hash[:15], 16)


def split_images(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
) -> list[ImageInput]:
    """The images of a processor's batched output (`pixel_values` of all images one after the other and
    `image_grid_thw` [n, 3]), one by one."""
    images, start = [], 0
    for t, h, w in torch.as_tensor(grid_thw).tolist():
        count = t * h * w
        images.append(ImageInput(pixel_values[start : start + count], (t, h, w)))
        start += count
    if start != pixel_values.shape[0]:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw accounts for {start}."
        )
    return images


# ---------------------------------------------------------------------------- multimodal RoPE positions
def mrope_axes(config: PretrainedConfig, num_frequencies: int) -> torch.Tensor:
    """Which of the three positions (0 temporal, 1 height, 2 width) drives each rotary frequency: the
    interleaved layout of `mrope_section` (frequency i is height's where i % 3 == 1 and i < 3 * sections[1],
    width's where i % 3 == 2 and i < 3 * sections[2], else temporal)."""
    sections = config.rope_parameters.get("mrope_section", [11, 11, 10])
    axes = torch.zeros(num_frequencies, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images placed on its tokens: where each image's placeholder tokens start, the three rotary
    positions of every prompt token [3, prompt tokens], and the shift `rope_delta` of every later token's
    positions from its index."""

    images: tuple[ImageInput, ...]
    starts: tuple[int, ...]
    rope_positions: torch.Tensor
    rope_delta: int
    spatial_merge_size: int

    def ends(self) -> tuple[int, ...]:
        sizes = (image.num_tokens(self.spatial_merge_size) for image in self.images)
        return tuple(start + size for start, size in zip(self.starts, sizes, strict=True))

    def positions(self, start: int, end: int) -> torch.Tensor:
        """The rotary positions [3, end - start] of the tokens at start..end (past the prompt: index +
        rope_delta)."""
        prompt = self.rope_positions.shape[1]
        inside = self.rope_positions[:, min(start, prompt) : min(end, prompt)]
        after = torch.arange(max(start, prompt), max(end, prompt)) + self.rope_delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)

    def cache_key_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's tokens with each image's placeholders replaced by its `cache_key_token`."""
        keys = list(prompt_ids)
        for image, start, end in zip(self.images, self.starts, self.ends(), strict=True):
            keys[start:end] = [image.cache_key_token()] * (end - start)
        return keys


def place_images(
    prompt_ids: Sequence[int],
    images: Sequence[ImageInput],
    placeholder_ids: Sequence[int],
    spatial_merge_size: int,
) -> PromptImages:
    """Match `images` (in order) to the runs of placeholder tokens (`placeholder_ids`: the image and video
    pad tokens) in the prompt, each image taking as many as its merged patches, and compute the prompt's
    rotary positions as transformers' `Qwen3_5Model.get_rope_index` does."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    is_placeholder = torch.isin(ids, torch.as_tensor(list(placeholder_ids), dtype=torch.long))
    needed = sum(image.num_tokens(spatial_merge_size) for image in images)
    if int(is_placeholder.sum()) != needed:
        raise ValueError(
            f"the prompt has {int(is_placeholder.sum())} image placeholder tokens, but its {len(images)} "
            f"image(s) need {needed} (one per {spatial_merge_size}x{spatial_merge_size} merged patch): "
            "render the prompt with the model's processor, which expands each image's placeholder."
        )
    placeholder_positions = torch.nonzero(is_placeholder).flatten().tolist()
    starts, pieces, index, position = [], [], 0, 0
    taken = 0
    for image in images:
        count = image.num_tokens(spatial_merge_size)
        start = placeholder_positions[taken]
        if placeholder_positions[taken + count - 1] != start + count - 1:
            raise ValueError(
                f"image {len(starts)}'s {count} placeholder tokens are not contiguous from position {start}."
            )
        text = start - index
        pieces.append(torch.arange(text).expand(3, -1) + position)
        position += text
        t, h, w = image.grid_thw
        grid = torch.stack(
            torch.meshgrid(
                torch.arange(t),
                torch.arange(h // spatial_merge_size),
                torch.arange(w // spatial_merge_size),
                indexing="ij",
            )
        ).reshape(3, -1)
        pieces.append(grid + position)
        position += max(h, w) // spatial_merge_size
        starts.append(start)
        index, taken = start + count, taken + count
    pieces.append(torch.arange(len(ids) - index).expand(3, -1) + position)
    rope_positions = torch.cat(pieces, dim=1)
    delta = int(rope_positions.max()) + 1 - len(ids)
    return PromptImages(tuple(images), tuple(starts), rope_positions, delta, spatial_merge_size)


# ---------------------------------------------------------------------------- the tower
@dataclass
class VisionGrid:
    """What the tower reads besides an image's patches, from its grid alone: the learned position table's
    interpolation taps and weights per patch [N, 4], each patch's (h, w) rotary position [N, 2], and which
    attention segment (frame) it belongs to [N]."""

    interp_indices: torch.Tensor
    interp_weights: torch.Tensor
    rotary_positions: torch.Tensor
    segments: torch.Tensor


def vision_grid(config: PretrainedConfig, grid_thw: Sequence[Sequence[int]]) -> VisionGrid:
    """The VisionGrid of images with these grids (transformers' own index helpers, as its tower uses)."""
    grid = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
    merge = config.spatial_merge_size
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid,
        num_grid_per_side=int(config.num_position_embeddings**0.5),
        mode="bilinear",
        align_corners=True,
        spatial_merge_size=merge,
    )
    rotary = get_vision_position_ids(grid, merge)
    cu_seqlens = get_vision_cu_seqlens(grid).long()
    segments = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())
    return VisionGrid(indices, weights, rotary, segments)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen36VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv(hidden).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation in float32, as transformers' tower does it.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class Qwen36VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen36VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = Qwen36VisionAttention(config)
        self.mlp = Qwen36VisionMLP(config)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), cos, sin, mask)
        return hidden + self.mlp(self.norm2(hidden))


class Qwen36VisionPatchEmbed(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # The convolution's kernel covers a whole patch: it is one matrix product over flattened patches.
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class Qwen36VisionPatchMerger(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        merged = self.norm(hidden).reshape(-1, self.merged_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(merged)))


class Qwen36VisionModel(nn.Module):
    """The vision tower: an image's patches [N, patch_dim] and its VisionGrid -> one feature per merged
    patch [N / merge^2, out_hidden_size]. Patches attend within their own frame only."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = Qwen36VisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(Qwen36VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen36VisionPatchMerger(config)
        self.register_buffer("inv_freq", self.vision_inv_freq(config), persistent=False)

    @staticmethod
    def vision_inv_freq(config: PretrainedConfig) -> torch.Tensor:
        """The 2-D rotary frequencies: a head's first half turns with the patch's row, the second with its
        column, each over a quarter of the head's dims."""
        spatial = config.hidden_size // config.num_heads // 2
        theta = config.rope_parameters["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))

    def forward(
        self,
        patches: torch.Tensor,
        interp_indices: torch.Tensor,
        interp_weights: torch.Tensor,
        rotary_positions: torch.Tensor,
        segments: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.patch_embed(patches)
        position = (self.pos_embed(interp_indices) * interp_weights.unsqueeze(-1)).sum(1)
        hidden = hidden + position.to(hidden.dtype)
        freqs = (rotary_positions.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [N, (h, w) x freqs]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        mask = segments.unsqueeze(0) == segments.unsqueeze(1)
        for block in self.blocks:
            hidden = block(hidden, cos, sin, mask)
        return self.merger(hidden)

    def encode(self, image: ImageInput) -> torch.Tensor:
        """The image's features [image tokens, out_hidden_size], in the tower's dtype."""
        grid = vision_grid(self.config, [image.grid_thw])
        device = self.inv_freq.device
        return self(
            image.pixel_values.to(device),
            grid.interp_indices.to(device),
            grid.interp_weights.to(device),
            grid.rotary_positions.to(device),
            grid.segments.to(device),
        )
