"""Linear layers written as matrix-vector products while tracing a one-row graph (batch-1 decode on CPU).

ATen runs a one-row bf16 `F.linear` through oneDNN's matrix-matrix kernels, which read the weight at 10-17
GB/s on this project's 2-core machine. Written as a multiply-and-sum over the weight's rows, Inductor compiles
it to one vectorised pass that streams the weight at 21-32 GB/s (float32 accumulation, as before;
benchmarks/bench_matvec.py). A decode step reads every weight once, so its time follows that rate
(docs/EXPORT.md, section 1c). The batched decode graph keeps `F.linear`: its row count is dynamic, and
the reduction over a dynamic number of rows is compiled to read each weight once per row.
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


class MatrixVectorLinears(TorchFunctionMode):
    """Within this mode, `F.linear` (every `nn.Linear`) on one row is traced as `matrix_vector_linear`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and args[0].shape[:-1].numel() == 1:
            x, weight, *rest = args
            return matrix_vector_linear(x, weight, rest[0] if rest else kwargs.get("bias"))
        return func(*args, **kwargs)
