"""GDN state checkpoints: the conv and recurrent state of every GDN layer of one sequence at position p.

A checkpoint is validated every time it is about to be used (layer count, shapes, dtypes, position,
key and a checksum taken when it was stored), so a corrupted, truncated or mislabelled state can
never be restored: the caller falls back to a shorter hit or a cold prefill instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Integer views used to checksum raw bits: sums of integers modulo 2^bits are exact and independent of the
# reduction order (a float sum is neither), so the checksum is reproducible on any device/thread count.
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class GDNStateSpec:
    """Expected layout of one sequence's GDN state (what the model's cache slot holds)."""

    num_layers: int
    conv_shape: tuple[int, ...]  # per layer: (conv_dim, kernel - 1)
    conv_dtype: torch.dtype
    recurrent_shape: tuple[int, ...]  # per layer: (value heads, key dim, value dim)
    recurrent_dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        conv = self.num_layers * _numel(self.conv_shape) * _itemsize(self.conv_dtype)
        rec = self.num_layers * _numel(self.recurrent_shape) * _itemsize(self.recurrent_dtype)
        return conv + rec

    def check(self, conv: torch.Tensor, recurrent: torch.Tensor) -> str | None:
        """Why (conv, recurrent) does not match this spec, or None when it does."""
        if tuple(conv.shape) != (self.num_layers, *self.conv_shape):
            return f"conv state shape {tuple(conv.shape)} != {(self.num_layers, *self.conv_shape)}"
        if tuple(recurrent.shape) != (self.num_layers, *self.recurrent_shape):
            expected = (self.num_layers, *self.recurrent_shape)
            return f"recurrent state shape {tuple(recurrent.shape)} != {expected}"
        if conv.dtype != self.conv_dtype:
            return f"conv state dtype {conv.dtype} != {self.conv_dtype}"
        if recurrent.dtype != self.recurrent_dtype:
            return f"recurrent state dtype {recurrent.dtype} != {self.recurrent_dtype}"
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_checksums(state: torch.Tensor) -> torch.Tensor:
    """Per-layer (dim 0) sums of the state's raw bits, shape [num_layers] int64.

    Each layer's bytes are read as the widest integer words its size allows (8, else 4 bytes, else the element
    size) and summed in that word's own width, wrapping: changing any one word changes the sum, and no widened
    copy of the state is made (a widening sum runs ~30x slower than the copy this validates, and it is on the
    path of every prefix cache hit).
    """
    flat = state.detach().reshape(state.shape[0], -1).contiguous()
    layer_bytes = flat.shape[1] * flat.element_size()
    size = next(size for size in (8, 4, flat.element_size()) if layer_bytes % size == 0)
    words = flat.view(torch.uint8).view(_WORD_DTYPES[size])
    return words.sum(dim=1, dtype=_WORD_DTYPES[size]).to(torch.int64).cpu()


@dataclass(eq=False)
class GDNCheckpoint:
    """Conv + recurrent state of all GDN layers after exactly ``position`` tokens of the prefix ``key``."""

    key: bytes
    position: int
    conv: torch.Tensor  # [num_layers, *conv_shape]
    recurrent: torch.Tensor  # [num_layers, *recurrent_shape], float32
    conv_checksum: torch.Tensor
    recurrent_checksum: torch.Tensor
    nbytes: int  # as stored: what the cache's budget accounts for, whatever happens to the tensors
    pins: int = 0  # > 0 while a sequence is about to restore it: never evicted then
    last_used: int = 0

    @classmethod
    def capture(
        cls,
        key: bytes,
        position: int,
        conv: torch.Tensor,
        recurrent: torch.Tensor,
    ) -> GDNCheckpoint:
        """Copy a slot's state (views of the live cache) into a new checkpoint, on the cache's device."""
        conv = conv.detach().clone(memory_format=torch.contiguous_format)
        recurrent = recurrent.detach().clone(memory_format=torch.contiguous_format)
        nbytes = conv.numel() * conv.element_size() + recurrent.numel() * recurrent.element_size()
        return cls(key, position, conv, recurrent, layer_checksums(conv), layer_checksums(recurrent), nbytes)

    def validate(self, spec: GDNStateSpec, key: bytes, position: int) -> str | None:
        """Why this checkpoint must not be used for prefix ``key`` at ``position``, or None if it is sound."""
        if self.key != key:
            return "key mismatch"
        if self.position != position:
            return f"position {self.position} != expected {position}"
        reason = spec.check(self.conv, self.recurrent)
        if reason is not None:
            return reason
        if self.conv_checksum.shape != (spec.num_layers,) or self.recurrent_checksum.shape != (
            spec.num_layers,
        ):
            return "checksum does not cover every layer"
        bad = (layer_checksums(self.conv) != self.conv_checksum) | (
            layer_checksums(self.recurrent) != self.recurrent_checksum
        )
        if bool(bad.any()):
            return f"checksum mismatch in GDN layer(s) {bad.nonzero().flatten().tolist()}"
        return None

    def restore_into(self, conv_dst: torch.Tensor, recurrent_dst: torch.Tensor) -> None:
        """Copy the state into a cache slot (views of the live cache tensors)."""
        conv_dst.copy_(self.conv)
        recurrent_dst.copy_(self.recurrent)
