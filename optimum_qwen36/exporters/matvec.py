"""How the linear layers of the step graphs are traced on CPU. A decode step is bound by reading the
weights:

bfloat16 weights, where the native kernel has a vector path: `optimum_qwen36::bf16_linear` (any row count;
it streams each weight once for up to 16 rows and hands more to ATen), which reads the weights faster than
ATen's bf16 `F.linear` from one to eight rows (benchmarks/bench_matvec.py, docs/EXPORT.md 1c).

Otherwise, on one row of a graph with static shapes (float32 weights, or bf16 where the kernel has no
vector path), a multiply-and-sum over the weight's rows (float32 accumulation), which Inductor compiles to one
vectorised pass over the weight. float32 weights on more rows (or a dynamic row count) are multiplied as
weight @ x.T: MKL's sgemm (torch's CPU BLAS) reads the weight once per x row in F.linear's orientation
(x @ weight.T) on AMD CPUs, and once for a few rows in this one (bench_matvec.py --dtype float32). Other
cases keep `F.linear`.

Prefill is bound by the matrix products' arithmetic: on a CPU without bf16 matrix instructions (AVX-512
BF16, AMX), ATen's bf16 product runs several times slower than its float32 one, so bf16 linears are traced
as the float32 product of the widened values, rounded once to bf16 (`WidenedLinears`): the accumulation
is float32 either way. Where the native kernel has its AVX2 path, that product is `bf16_linear`'s: it
streams a chunk of up to 16 tokens through the weight like a decode step, and widens larger chunks' weights
a tile of rows at a time, never the whole weight into memory.
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


class _LinearTracing(TorchFunctionMode):
    """Traces `F.linear` (every `nn.Linear`) as `self.linear(x, weight, bias)` says; None keeps F.linear."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight, *rest = args
        traced = self.linear(x, weight, rest[0] if rest else kwargs.get("bias"))
        return func(*args, **kwargs) if traced is None else traced


class DecodeLinears(_LinearTracing):
    """Within this mode, `F.linear` (every `nn.Linear`) is traced as `optimum_qwen36::bf16_linear` for
    bfloat16 weights when `native_bf16` (any row count); else, in a graph of static shapes (`static_rows`),
    on one row as `matrix_vector_linear`; else, for float32 weights, as `weight_major_linear`. Dynamic row
    counts are never inspected (that would specialize them)."""

    def __init__(self, native_bf16: bool, static_rows: bool) -> None:
        super().__init__()
        self.native_bf16 = native_bf16
        self.static_rows = static_rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.native_bf16 and x.dtype == weight.dtype == torch.bfloat16 and weight.dim() == 2:
            return torch.ops.optimum_qwen36.bf16_linear(x, weight, bias)
        if self.static_rows and x.shape[:-1].numel() == 1:
            return matrix_vector_linear(x, weight, bias)
        if x.dtype == weight.dtype == torch.float32 and weight.dim() == 2:
            return weight_major_linear(x, weight, bias)
        return None


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear as the float32 product of the widened values (exact: a bf16 is a float32's top half),
    rounded once to x's dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


class WidenedLinears(_LinearTracing):
    """Within this mode, `F.linear` on bfloat16 x and weight is traced as their float32 product: as
    `optimum_qwen36::bf16_linear` where `native_bf16` (2-D weights), else as `widened_linear`."""

    def __init__(self, native_bf16: bool) -> None:
        super().__init__()
        self.native_bf16 = native_bf16

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            return None
        if self.native_bf16 and weight.dim() == 2:
            return torch.ops.optimum_qwen36.bf16_linear(x, weight, bias)
        return widened_linear(x, weight, bias)
