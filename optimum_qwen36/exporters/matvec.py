"""How the linear layers of the decode graphs are traced on CPU, where a decode step is bound by reading
the weights.

bfloat16 weights, where the native kernel is built with AVX-512 BF16: `optimum_qwen36::bf16_linear` (any
row count; it streams each weight once for up to 16 rows and hands more to ATen), which reads the weights
faster than ATen's bf16 `F.linear` from one to eight rows (benchmarks/bench_matvec.py, docs/EXPORT.md 1c).

Otherwise, on one row of a graph with static shapes (float32 weights, or bf16 where the kernel is not
built), a multiply-and-sum over the weight's rows (float32 accumulation), which Inductor compiles to one
vectorised pass over the weight. float32 weights on more rows (or a dynamic row count) are multiplied as
weight @ x.T: MKL's sgemm (torch's CPU BLAS) reads the weight once per x row in F.linear's orientation
(x @ weight.T) on AMD CPUs, and once for a few rows in this one (bench_matvec.py --dtype float32). Other
cases keep `F.linear`.
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


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear computed as (weight @ x.T).T, the orientation in which BLAS streams the weight once for a
    few x rows."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, rows.t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class DecodeLinears(TorchFunctionMode):
    """Within this mode, `F.linear` (every `nn.Linear`) is traced as `optimum_qwen36::bf16_linear` for
    bfloat16 weights when `native_bf16` (any row count); else, in a graph of static shapes (`static_rows`),
    on one row as `matrix_vector_linear`; else, for float32 weights, as `weight_major_linear`. Dynamic row
    counts are never inspected (that would specialize them)."""

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
        if x.dtype == weight.dtype == torch.float32 and weight.dim() == 2:
            return weight_major_linear(x, weight, bias)
        return func(*args, **kwargs)
