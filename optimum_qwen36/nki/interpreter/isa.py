"""The ``nki.isa`` instructions the GDN kernels use, with the operand rules of the NKI 2.33 docs.

Every instruction writes into an explicit ``dst`` (the current API) and computes in float32 (engines
cast inputs to float32; results are cast to ``dst.dtype``). Operand-placement rules enforced:

* ``nc_matmul``: stationary and moving in SBUF, same partition size <= 128, stationary free <= 128,
  moving free <= 512, dst a float32 PSUM tile of shape (stationary free, moving free); ``accumulate``
  must be given explicitly (True adds into dst, False overwrites).
* ``nc_transpose``: Tensor Engine reads SBUF, writes PSUM (<= 128 x 128 follows from the partition
  limit); Vector Engine reads and writes SBUF or PSUM, at most 32 x 32; dst has data's dtype.
* ``tensor_tensor``: the two inputs are not both in PSUM.
* ``affine_select``: GpSimd Engine, so no PSUM operands.
* ``dma_copy``: HBM and SBUF only (never PSUM), no dtype conversion.

Unmodelled options (accumulate=None, reduce registers, other operators, non-2-D reductions) raise
:class:`NkiUnsupportedError`; keyword arguments the interpreter does not know (tile_position, masks,
perf modes...) are rejected by Python with a TypeError.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from optimum_qwen36.nki.interpreter import language as nl
from optimum_qwen36.nki.interpreter.tensor import (
    FLOAT_DTYPES,
    PMAX,
    MemoryRegion,
    NkiLimitError,
    NkiTensor,
    NkiUnsupportedError,
    float32,
)

__all__ = [
    "activation",
    "affine_select",
    "dma_copy",
    "engine",
    "memset",
    "nc_matmul",
    "nc_transpose",
    "tensor_copy",
    "tensor_reduce",
    "tensor_scalar",
    "tensor_tensor",
]

SBUF, PSUM = MemoryRegion.sbuf, MemoryRegion.psum


class _Engine(enum.Enum):
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


engine = _Engine  # nki.isa.engine


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise NkiLimitError(message)


def _tile(x: object, role: str, buffers: tuple[MemoryRegion, ...] = (SBUF, PSUM)) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise NkiUnsupportedError(f"{role} must be an NkiTensor, got {type(x).__name__}")
    _check(
        x.buffer in buffers, f"{role} must be in {'/'.join(b.value for b in buffers)}, not {x.buffer.value}"
    )
    _check(len(x.shape) >= 2 and x.shape[0] <= PMAX, f"{role} shape {x.shape}: needs partition dim <= {PMAX}")
    return x


def _same_shape(a: NkiTensor, b: NkiTensor, what: str) -> None:
    _check(a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape} differ")


def _op(op: object, kinds: tuple[str, ...], role: str = "op") -> nl.Op:
    if not isinstance(op, nl.Op) or op.kind not in kinds:
        raise NkiUnsupportedError(f"{role} {op!r} is not a modelled {'/'.join(kinds)} operator")
    return op


def _per_partition(operand: object, partitions: int, role: str) -> np.ndarray | float:
    """A compile-time scalar or a (partitions, 1) tile, as something that broadcasts over the free dim."""
    if isinstance(operand, (int, float, np.floating, np.integer)) and not isinstance(operand, bool):
        return float(operand)
    tile = _tile(operand, role)
    _check(tile.shape == (partitions, 1), f"{role} tile must have shape ({partitions}, 1), got {tile.shape}")
    return tile.read()


def nc_matmul(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    accumulate: bool | None = None,
    name: str | None = None,
) -> None:
    """dst (+)= stationary.T @ moving on the Tensor Engine, float32 accumulation."""
    _tile(dst, "nc_matmul dst", (PSUM,))
    _tile(stationary, "nc_matmul stationary", (SBUF,))
    _tile(moving, "nc_matmul moving", (SBUF,))
    _check(len(stationary.shape) == 2 and len(moving.shape) == 2, "nc_matmul operands must be 2-D tiles")
    (k_s, m), (k_m, n) = stationary.shape, moving.shape
    _check(k_s == k_m, f"nc_matmul contraction (partition) sizes differ: {k_s} vs {k_m}")
    _check(m <= 128, f"nc_matmul stationary free size {m} > 128")
    _check(n <= 512, f"nc_matmul moving free size {n} > 512")
    _check(dst.shape == (m, n), f"nc_matmul dst shape {dst.shape} != ({m}, {n})")
    _check(dst.dtype is float32, f"nc_matmul accumulates in float32; dst is {dst.dtype!r}")
    for tile, role in ((stationary, "stationary"), (moving, "moving")):
        if tile.dtype not in FLOAT_DTYPES:
            raise NkiUnsupportedError(f"nc_matmul {role} dtype {tile.dtype!r} is not modelled")
    if accumulate is None:
        raise NkiUnsupportedError(
            "nc_matmul accumulate=None (compiler-inferred) is not modelled: pass True/False"
        )
    product = stationary.read().T @ moving.read()
    dst.write(dst.read() + product if accumulate else product)


def nc_transpose(
    dst: NkiTensor, data: NkiTensor, engine: _Engine = _Engine.unknown, name: str | None = None
) -> None:
    """dst = data.T (partition <-> free) on the Tensor Engine (SBUF -> PSUM) or Vector Engine (<= 32x32)."""
    _tile(dst, "nc_transpose dst")
    _tile(data, "nc_transpose data")
    _check(len(data.shape) == 2, "nc_transpose data must be a 2-D tile")
    _check(dst.shape == data.shape[::-1], f"nc_transpose dst shape {dst.shape} != {data.shape[::-1]}")
    _check(dst.dtype is data.dtype, "nc_transpose dst must have data's dtype")
    chosen = engine
    if chosen is _Engine.unknown:
        chosen = _Engine.tensor if (data.buffer, dst.buffer) == (SBUF, PSUM) else _Engine.vector
    if chosen is _Engine.tensor:
        _check(
            (data.buffer, dst.buffer) == (SBUF, PSUM), "Tensor Engine nc_transpose reads SBUF, writes PSUM"
        )
    elif chosen is _Engine.vector:
        _check(max(data.shape) <= 32, f"Vector Engine nc_transpose is at most 32x32, got {data.shape}")
    else:
        raise NkiUnsupportedError(f"nc_transpose on {chosen} is not modelled")
    dst.write(data.read().T)


def tensor_tensor(
    dst: NkiTensor,
    data1: NkiTensor,
    data2: NkiTensor,
    op: nl.Op,
    engine: _Engine = _Engine.unknown,
    name: str | None = None,
) -> None:
    """dst = data1 <op> data2 elementwise (Vector Engine)."""
    binary = _op(op, ("binary",))
    for tile, role in ((dst, "dst"), (data1, "data1"), (data2, "data2")):
        _tile(tile, f"tensor_tensor {role}")
    _check(not (data1.buffer is PSUM and data2.buffer is PSUM), "tensor_tensor inputs cannot both be in PSUM")
    _same_shape(data1, data2, "tensor_tensor inputs")
    _same_shape(dst, data1, "tensor_tensor dst")
    dst.write(binary.fn(data1.read(), data2.read()))


def tensor_scalar(
    dst: NkiTensor,
    data: NkiTensor,
    op0: nl.Op,
    operand0: float | NkiTensor,
    reverse0: bool = False,
    op1: nl.Op | None = None,
    operand1: float | NkiTensor | None = None,
    reverse1: bool = False,
    engine: _Engine = _Engine.unknown,
    name: str | None = None,
) -> None:
    """dst = (data <op0> operand0) <op1> operand1, operands scalars or (P, 1) tiles broadcast along free."""
    _tile(dst, "tensor_scalar dst")
    _tile(data, "tensor_scalar data")
    _same_shape(dst, data, "tensor_scalar dst")
    partitions = data.shape[0]
    result = data.read()
    steps = [(op0, operand0, reverse0, "op0")]
    if op1 is not None or operand1 is not None:
        _check(op1 is not None and operand1 is not None, "tensor_scalar op1 and operand1 go together")
        steps.append((op1, operand1, reverse1, "op1"))
    for op, operand, reverse, role in steps:
        fn = _op(op, ("binary",), role).fn
        value = _per_partition(operand, partitions, f"tensor_scalar operand of {role}")
        result = fn(value, result) if reverse else fn(result, value)
    dst.write(result)


def activation(
    dst: NkiTensor,
    op: nl.Op,
    data: NkiTensor,
    bias: float | NkiTensor | None = None,
    scale: float | NkiTensor = 1.0,
    reduce_op: nl.Op | None = None,
    name: str | None = None,
) -> None:
    """dst = op(data * scale + bias) on the Scalar Engine (float32 math)."""
    fn = _op(op, ("activation",)).fn
    if reduce_op is not None:
        raise NkiUnsupportedError("activation reduce registers are not modelled")
    _tile(dst, "activation dst")
    _tile(data, "activation data")
    _same_shape(dst, data, "activation dst")
    partitions = data.shape[0]
    pre = data.read() * _per_partition(scale, partitions, "activation scale")
    if bias is not None:
        pre = pre + _per_partition(bias, partitions, "activation bias")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        dst.write(fn(pre))


def tensor_reduce(
    dst: NkiTensor,
    op: nl.Op,
    data: NkiTensor,
    axis: int | Sequence[int],
    negate: bool = False,
    keepdims: bool = False,
    name: str | None = None,
) -> None:
    """dst[p, 0] = reduce(op, data[p, :]) over the free axis of a 2-D tile (Vector Engine)."""
    reducer = _op(op, ("binary",))
    _tile(dst, "tensor_reduce dst")
    _tile(data, "tensor_reduce data")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(data.shape) != 2 or axes != (1,):
        raise NkiUnsupportedError("tensor_reduce is modelled for 2-D tiles reduced over axis 1 only")
    _check(dst.shape == (data.shape[0], 1), f"tensor_reduce dst shape {dst.shape} != ({data.shape[0]}, 1)")
    result = reducer.fn.reduce(data.read(), axis=1, keepdims=True)
    dst.write(-result if negate else result)


def tensor_copy(
    dst: NkiTensor, src: NkiTensor, engine: _Engine = _Engine.unknown, name: str | None = None
) -> None:
    """dst = src cast to dst.dtype (within SBUF/PSUM)."""
    _tile(dst, "tensor_copy dst")
    _tile(src, "tensor_copy src")
    _same_shape(dst, src, "tensor_copy")
    dst.write(src.read())


def memset(dst: NkiTensor, value: float, engine: _Engine = _Engine.unknown, name: str | None = None) -> None:
    _tile(dst, "memset dst")
    dst.write(np.full(dst.shape, value, dtype=np.float32))


def affine_select(
    dst: NkiTensor,
    pattern: Sequence[Sequence[int]],
    offset: int,
    channel_multiplier: int,
    on_true_tile: NkiTensor,
    on_false_value: float,
    cmp_op: nl.Op = nl.equal,
    name: str | None = None,
) -> None:
    """dst[p, f] = on_true_tile[p, f] if cmp(offset + p * channel_multiplier + affine(f), 0) else on_false.

    ``pattern`` is [[step, count], ...] (outermost first) over the flattened free dimension (GpSimd Engine).
    """
    compare = _op(cmp_op, ("compare",), "cmp_op").fn
    _tile(dst, "affine_select dst", (SBUF,))
    _tile(on_true_tile, "affine_select on_true_tile", (SBUF,))
    _same_shape(dst, on_true_tile, "affine_select")
    free = int(np.prod(dst.shape[1:]))
    counts = [int(count) for _, count in pattern]
    _check(
        1 <= len(pattern) <= 4 and int(np.prod(counts)) == free,
        f"affine_select pattern {pattern} does not cover the {free} free elements",
    )
    value = np.full((dst.shape[0], 1), float(offset)) + channel_multiplier * np.arange(dst.shape[0])[:, None]
    free_value = np.zeros(1)
    for step, count in pattern:  # outermost first: row-major flattening of the free index
        free_value = (free_value[:, None] + step * np.arange(count)[None, :]).reshape(-1)
    predicate = compare(value + free_value[None, :], 0).reshape(dst.shape)
    dst.write(np.where(predicate, on_true_tile.read(), np.float32(on_false_value)))


def dma_copy(dst: NkiTensor, src: NkiTensor, name: str | None = None) -> None:
    """dst = src through a DMA engine: between HBM and SBUF (either direction, or within one)."""
    for tile, role in ((dst, "dst"), (src, "src")):
        if not isinstance(tile, NkiTensor):
            raise NkiUnsupportedError(f"dma_copy {role} must be an NkiTensor")
        _check(tile.buffer is not PSUM, f"dma_copy {role} cannot be in PSUM")
        if tile.buffer is SBUF:
            _tile(tile, f"dma_copy {role}", (SBUF,))
    _same_shape(dst, src, "dma_copy")
    _check(dst.dtype is src.dtype, f"dma_copy does not convert dtypes ({src.dtype!r} -> {dst.dtype!r})")
    dst.data[...] = src.data
