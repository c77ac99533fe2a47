"""What a backend is: the two static-shape steps of the model, however they were compiled."""

from __future__ import annotations

from typing import Protocol

import torch

from ..modeling.qwen36 import Qwen36ForCausalLM


class StepBackend(Protocol):
    """Runs `Qwen36ForCausalLM.prefill_chunk` and `.decode_step` (same arguments, same results)."""

    name: str
    # Whether decode_step accepts fewer rows than the exported batch (else callers pad to the full batch).
    decodes_any_batch: bool

    def prefill_chunk(self, *args: torch.Tensor) -> torch.Tensor: ...

    def decode_step(self, *args: torch.Tensor) -> torch.Tensor: ...


class EagerBackend:
    """The reference backend: the model's own PyTorch code, uncompiled."""

    name = "eager"
    decodes_any_batch = True

    def __init__(self, model: Qwen36ForCausalLM) -> None:
        self.model = model

    @torch.no_grad()
    def prefill_chunk(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model.prefill_chunk(*args)

    @torch.no_grad()
    def decode_step(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model.decode_step(*args)
