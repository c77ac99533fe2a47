"""Shared test utilities: left-padded random prompts and exporting a tiny checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from optimum_qwen36 import NeuronQwen36ForCausalLM


def left_padded_prompts(
    lengths: list[int], vocab_size: int = 512, seed: int = 0, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded to the longest: (input_ids, attention_mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def export_eager(checkpoint: Path, **settings: Any) -> NeuronQwen36ForCausalLM:
    defaults: dict[str, Any] = dict(
        backend="eager", batch_size=3, sequence_length=256, dtype="float32", prefill_chunk_size=16
    )
    return NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, **{**defaults, **settings})


class CountingBackend:
    """Wraps a backend and counts the tokens each step kind was given (to prove what was recomputed)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.name = backend.name
        self.prefill_tokens = 0
        self.decode_steps = 0

    def prefill_chunk(self, *args: torch.Tensor) -> torch.Tensor:
        self.prefill_tokens += int(args[2])
        return self.backend.prefill_chunk(*args)

    def decode_step(self, *args: torch.Tensor) -> torch.Tensor:
        self.decode_steps += 1
        return self.backend.decode_step(*args)
