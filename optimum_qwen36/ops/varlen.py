"""Sequences packed along the tokens (a packed prefill step): what the ops' PyTorch forms share."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch


def sequence_spans(cu_seqlens: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """(s, tokens of sequence s) for each sequence that has tokens (sequence s is tokens cu_seqlens[s]..
    cu_seqlens[s + 1]). It reads cu_seqlens' values: for the eager PyTorch forms, not traced graphs."""
    for s, (first, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        if end > first:
            yield s, slice(first, end)
