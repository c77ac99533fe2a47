"""Tensors, dtypes, memory regions and on-chip capacity accounting of the NKI interpreter.

A tensor is a numpy view (``data``) into an allocation on one memory region. On-chip tensors
(SBUF, PSUM) have the partition dimension first; its size is at most 128. Capacity is charged per
partition while an allocation is alive (Python reference counting stands in for the compiler's
liveness analysis): SBUF 192 KiB per partition, PSUM 8 banks of 2 KiB per partition, a PSUM tile
must fit one bank.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

PMAX = 128  # partitions of SBUF / PSUM
SBUF_BYTES_PER_PARTITION = 192 * 1024  # trn2: 24 MiB / 128 partitions (trn3 has more; stay conservative)
PSUM_BANK_BYTES = 2 * 1024  # per partition; 512 float32
PSUM_BANKS = 8


class NkiInterpreterError(Exception):
    """Base class: the interpreter refused to run something."""


class NkiLimitError(NkiInterpreterError):
    """A documented hardware or API limit was violated (partition size, PSUM bank, operand buffer...)."""


class NkiUnsupportedError(NkiInterpreterError):
    """The construct exists in NKI but this interpreter does not model it."""


class MemoryRegion(enum.Enum):
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    @property
    def on_chip(self) -> bool:
        return self in (MemoryRegion.sbuf, MemoryRegion.psum)


@dataclass(frozen=True)
class DType:
    """An NKI dtype. bfloat16 is stored in float32 arrays, rounded to bf16 on every write."""

    name: str
    storage: type[np.generic]
    itemsize: int

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def cast(self, values: np.ndarray) -> np.ndarray:
        """values (any float/int array) converted to this dtype's storage, rounding to nearest even."""
        if self.name == "bfloat16":
            return _round_to_bfloat16(np.asarray(values, dtype=np.float32))
        return np.asarray(values).astype(self.storage)


def _round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out)


float32 = DType("float32", np.float32, 4)
bfloat16 = DType("bfloat16", np.float32, 2)
float16 = DType("float16", np.float16, 2)
int32 = DType("int32", np.int32, 4)
FLOAT_DTYPES = (float32, bfloat16, float16)


class _Accounting:
    """Live on-chip bytes per partition (SBUF) and live PSUM banks for one kernel run."""

    def __init__(self) -> None:
        self.sbuf_bytes = 0
        self.psum_banks = 0

    def charge(self, region: MemoryRegion, bytes_per_partition: int) -> None:
        if region is MemoryRegion.sbuf:
            if self.sbuf_bytes + bytes_per_partition > SBUF_BYTES_PER_PARTITION:
                raise NkiLimitError(
                    f"SBUF overflow: {self.sbuf_bytes} live + {bytes_per_partition} new bytes per partition "
                    f"> {SBUF_BYTES_PER_PARTITION}"
                )
            self.sbuf_bytes += bytes_per_partition
        elif region is MemoryRegion.psum:
            if bytes_per_partition > PSUM_BANK_BYTES:
                raise NkiLimitError(
                    f"PSUM tile of {bytes_per_partition} bytes per partition does not fit one "
                    f"{PSUM_BANK_BYTES}-byte bank (at most 512 float32 free elements)"
                )
            if self.psum_banks + 1 > PSUM_BANKS:
                raise NkiLimitError(f"PSUM overflow: more than {PSUM_BANKS} banks live at once")
            self.psum_banks += 1

    def release(self, region: MemoryRegion, bytes_per_partition: int) -> None:
        if region is MemoryRegion.sbuf:
            self.sbuf_bytes -= bytes_per_partition
        elif region is MemoryRegion.psum:
            self.psum_banks -= 1


_accounting = _Accounting()


def reset_accounting() -> _Accounting:
    """Start a fresh capacity account (one per kernel run); returns it for inspection."""
    global _accounting
    _accounting = _Accounting()
    return _accounting


class _Allocation:
    """Backing storage; charged to the account that was current when it was created."""

    def __init__(self, shape: tuple[int, ...], dtype: DType, region: MemoryRegion) -> None:
        self.array = np.zeros(shape, dtype=dtype.storage)
        if region.on_chip:
            per_partition = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            account = _accounting
            account.charge(region, per_partition)
            weakref.finalize(self, account.release, region, per_partition)


class ds:
    """nl.ds(start, size): a dynamic-slice descriptor (here always static)."""

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = int(start), int(size)


class NkiTensor:
    """A view of an allocation on one memory region."""

    def __init__(self, allocation: _Allocation, data: np.ndarray, dtype: DType, buffer: MemoryRegion) -> None:
        self._allocation = allocation  # keeps the storage (and its capacity charge) alive
        self.data = data
        self.dtype = dtype
        self.buffer = buffer

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def __repr__(self) -> str:
        return f"NkiTensor(shape={self.shape}, dtype={self.dtype!r}, buffer={self.buffer.value})"

    def __getitem__(self, index: Any) -> NkiTensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.shape):
            raise NkiLimitError(f"too many indices {index} for shape {self.shape}")
        key: list[int | slice] = []
        for dim, (item, size) in enumerate(zip(index, self.shape, strict=False)):
            key.append(_normalise_index(item, size, dim))
        if self.buffer.on_chip and not isinstance(key[0], slice):
            raise NkiUnsupportedError("integer index on the partition dimension of an on-chip tensor")
        return NkiTensor(self._allocation, self.data[tuple(key)], self.dtype, self.buffer)

    def __setitem__(self, index: Any, value: Any) -> None:
        raise NkiUnsupportedError("tensor assignment is not modelled; write through an nki.isa instruction")

    def write(self, values: np.ndarray) -> None:
        """Store values (cast to this tensor's dtype) into the view."""
        values = np.asarray(values)
        if values.shape != self.shape:
            raise NkiLimitError(f"shape mismatch writing {values.shape} into {self.shape}")
        self.data[...] = self.dtype.cast(values)

    def read(self) -> np.ndarray:
        """The view's values as float32 (int32 stays int32): what an engine computes with."""
        return self.data.astype(np.int32 if self.dtype is int32 else np.float32)


def _normalise_index(item: Any, size: int, dim: int) -> int | slice:
    if isinstance(item, ds):
        item = slice(item.start, item.start + item.size)
    if isinstance(item, slice):
        if item.step not in (None, 1):
            raise NkiUnsupportedError(f"strided slice on dim {dim} is not modelled")
        start = 0 if item.start is None else item.start
        stop = size if item.stop is None else item.stop
        if not 0 <= start < stop <= size:
            raise NkiLimitError(
                f"slice [{start}:{stop}] out of bounds (or empty) for dim {dim} of size {size}"
            )
        return slice(start, stop)
    if isinstance(item, (int, np.integer)):
        if not 0 <= item < size:
            raise NkiLimitError(f"index {item} out of bounds for dim {dim} of size {size}")
        return int(item)
    raise NkiUnsupportedError(f"index {item!r} of type {type(item).__name__} is not modelled")


def allocate(
    shape: tuple[int, ...] | list[int], dtype: DType, buffer: MemoryRegion, fill: float = 0.0
) -> NkiTensor:
    """A new tensor filled with ``fill``."""
    shape = tuple(int(s) for s in shape)
    if not isinstance(dtype, DType):
        raise NkiUnsupportedError(f"dtype {dtype!r} is not an interpreter dtype (use nl.float32, ...)")
    if not isinstance(buffer, MemoryRegion):
        raise NkiUnsupportedError(f"buffer {buffer!r} is not modelled")
    if not shape or any(s <= 0 for s in shape):
        raise NkiLimitError(f"invalid shape {shape}")
    if buffer.on_chip:
        if len(shape) < 2:
            raise NkiLimitError(f"on-chip tensor needs a partition and a free dimension, got shape {shape}")
        if shape[0] > PMAX:
            raise NkiLimitError(f"partition dimension {shape[0]} > {PMAX}")
    allocation = _Allocation(shape, dtype, buffer)
    allocation.array[...] = fill
    return NkiTensor(allocation, allocation.array, dtype, buffer)


def hbm_from_array(values: np.ndarray, dtype: DType) -> NkiTensor:
    """A kernel argument: a copy of values in shared HBM."""
    tensor = allocate(values.shape, dtype, MemoryRegion.shared_hbm)
    tensor.write(values)
    return tensor
