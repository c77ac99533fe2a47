"""How the linear layers of the decode graphs are traced on CPU, where a decode step is bound by reading
the weights.

bfloat16 weights, where the native kernel is built with AVX-512 BF16: `optimum_qwen36::bf16_linear` (any
row count; it streams each weight once for up to 16 rows and hands more to ATen), which reads the weights
faster than ATen's bf16 `F.linear` from one to eight rows (benchmarks/bench_matvec.py, docs/EXPORT.md 1c).

Otherwise, on one row (float32 weights, or bf16 where the kernel is not built), a multiply-and-sum over
the weight's rows (float32 accumulation), which Inductor compiles to one vectorised pass over the weight.
More rows keep `F.linear`: a reduction over a dynamic number of rows is compiled to read each weight once
per row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def matrix_vector_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for an x of one row, as a multiply-and-sum over the weight's rows, accumulated in float32."""
    y = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class DecodeLinears(TorchFunctionMode):
    """Within this mode, `F.linear` (every `nn.Linear`) is traced as `optimum_qwen36::bf16_linear` for
    bfloat16 weights when `native_bf16` (any row count), else, in a graph of static shapes (`static_rows`),
    on one row as `matrix_vector_linear`. Dynamic row counts are never inspected (that would specialize
    them)."""

    def __init__(self, native_bf16: bool, static_rows: bool) -> None:
        super().__init__()
        self.native_bf16 = native_bf16
        self.static_rows = static_rows

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, *rest = args
        bias = rest[0] if rest else kwargs.get("bias")
        if self.native_bf16 and x.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 2:
            return torch.ops.optimum_qwen36.bf16_linear(x, weight, bias)
        if self.static_rows and x.shape[:-1].numel() == 1:
            return matrix_vector_linear(x, weight, bias)
        return func(*args, **kwargs)
