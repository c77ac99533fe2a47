"""Prefill chunk schedule that ends a chunk exactly at every GDN checkpoint position.

The model's ``prefill_chunk`` takes ``num_valid <= C`` tokens, so the state at any position p is
available by ending a chunk at p and copying the row's slot: no extra graph outputs are needed.
"""

from __future__ import annotations

from collections.abc import Iterable


def plan_prefill_chunks(
    start: int, end: int, chunk_size: int, stops: Iterable[int] = ()
) -> list[tuple[int, int]]:
    """Split tokens ``[start, end)`` into ``(chunk_start, num_valid)`` chunks of at most ``chunk_size``.

    Every stop strictly inside ``(start, end)`` ends a chunk; after a stop the next chunk starts
    there, so chunk starts stay aligned to the stops (multiples of the kernel chunk).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= start < end:
        raise ValueError(f"need 0 <= start < end, got start={start}, end={end}")
    cuts = sorted({s for s in stops if start < s < end})
    chunks = []
    pos = start
    for boundary in [*cuts, end]:
        while pos < boundary:
            n = min(chunk_size, boundary - pos)
            chunks.append((pos, n))
            pos += n
    return chunks
