"""The ``nki.language`` subset the GDN kernels use: tensor creation, memory regions, dtypes, ``ds`` and
the math-operator tokens that ``nki.isa`` instructions take as ``op`` arguments.

High-level tile math (``nl.add(a, b)``, ``nl.matmul``, ``nl.load`` ...) is not modelled: calling an
operator token directly raises.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from optimum_qwen36.nki.interpreter.tensor import (
    DType,
    MemoryRegion,
    NkiTensor,
    NkiUnsupportedError,
    allocate,
    bfloat16,
    ds,
    float16,
    float32,
    int32,
)

__all__ = [
    "NkiTensor",
    "add",
    "bfloat16",
    "ds",
    "equal",
    "exp",
    "float16",
    "float32",
    "greater_equal",
    "hbm",
    "int32",
    "multiply",
    "ndarray",
    "private_hbm",
    "psum",
    "rsqrt",
    "sbuf",
    "shared_hbm",
    "subtract",
    "zeros",
]

sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm
hbm = MemoryRegion.private_hbm  # documented alias


class Op:
    """An operator token such as ``nl.add``: ``nisa`` instructions evaluate it elementwise in float32."""

    def __init__(self, name: str, kind: str, fn: Callable[..., np.ndarray]) -> None:
        self.name, self.kind, self.fn = name, kind, fn

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NkiUnsupportedError(
            f"nl.{self.name}(...) as a tile function is not modelled; pass it as an "
            "op to an nki.isa instruction"
        )


def _binary(name: str, fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Op:
    return Op(name, "binary", fn)


def _unary(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Op:
    return Op(name, "activation", fn)


add = _binary("add", np.add)
subtract = _binary("subtract", np.subtract)
multiply = _binary("multiply", np.multiply)
equal = Op("equal", "compare", np.equal)
greater_equal = Op("greater_equal", "compare", np.greater_equal)
exp = _unary("exp", np.exp)
rsqrt = _unary("rsqrt", lambda x: 1.0 / np.sqrt(x))


def ndarray(shape: tuple[int, ...], dtype: DType, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    """A new tensor on ``buffer``. Contents are unspecified on hardware: floats are poisoned with NaN
    (integers with INT32_MIN) so that a kernel reading memory it never wrote fails its tests."""
    return allocate(shape, dtype, buffer, fill=np.iinfo(np.int32).min if dtype is int32 else np.nan)


def zeros(shape: tuple[int, ...], dtype: DType, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    return allocate(shape, dtype, buffer)
