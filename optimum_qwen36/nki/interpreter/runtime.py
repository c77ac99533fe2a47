"""The ``nki`` top-level subset: ``jit`` and ``simulate``.

A jitted kernel called with numpy arrays or (CPU) torch tensors runs eagerly on the interpreter: each
array argument becomes a shared-HBM tensor, scalars are passed through as compile-time constants, and
the HBM tensors the kernel returns come back as arrays of the same kind as the inputs (torch if any
input was torch). ``simulate(kernel)`` is the same call, mirroring ``nki.simulate``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from optimum_qwen36.nki.interpreter.tensor import (
    MemoryRegion,
    NkiTensor,
    NkiUnsupportedError,
    bfloat16,
    float16,
    float32,
    hbm_from_array,
    int32,
    reset_accounting,
)

_NUMPY_DTYPES = {np.dtype(np.float32): float32, np.dtype(np.float16): float16, np.dtype(np.int32): int32}


class Kernel:
    """A kernel function wrapped by :func:`jit`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        uses_torch = any(_is_torch(a) for a in (*args, *kwargs.values()))
        reset_accounting()
        result = self.fn(*(_to_kernel(a) for a in args), **{k: _to_kernel(v) for k, v in kwargs.items()})
        if isinstance(result, tuple):
            return tuple(_from_kernel(r, uses_torch) for r in result)
        return _from_kernel(result, uses_torch)


def jit(fn: Callable[..., Any] | None = None) -> Kernel | Callable[[Callable[..., Any]], Kernel]:
    """``@nki.jit`` or ``@nki.jit()``; platform/compiler options are not modelled."""
    if fn is None:
        return Kernel
    return Kernel(fn)


def simulate(kernel: Kernel | Callable[..., Any]) -> Kernel:
    """``nki.simulate(kernel)``: here the interpreter is the simulator."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _to_kernel(value: Any) -> Any:
    if _is_torch(value):
        import torch

        if value.device.type != "cpu":
            raise NkiUnsupportedError(f"the interpreter runs on CPU tensors, got device {value.device}")
        if value.dtype == torch.bfloat16:
            return hbm_from_array(value.detach().float().numpy(), bfloat16)
        value = value.detach().numpy()
    if isinstance(value, np.ndarray):
        dtype = _NUMPY_DTYPES.get(value.dtype)
        if dtype is None:
            raise NkiUnsupportedError(f"array dtype {value.dtype} is not modelled")
        return hbm_from_array(value, dtype)
    return value


def _from_kernel(value: Any, as_torch: bool) -> Any:
    if not isinstance(value, NkiTensor) or value.buffer not in (
        MemoryRegion.shared_hbm,
        MemoryRegion.private_hbm,
    ):
        raise NkiUnsupportedError(f"a kernel must return HBM tensors, got {value!r}")
    array = value.data.copy()
    if not as_torch:
        return array
    import torch

    tensor = torch.from_numpy(array)
    return tensor.to(torch.bfloat16) if value.dtype is bfloat16 else tensor
