"""MTP drafting for speculative decoding: the checkpoint's multi-token-prediction layer proposes the next
tokens of each decoding request, which the engine's verify step then checks (sampling.verify_drafts).

The MTP layer at position i reads (h_i, x_{i+1}): the trunk's normed hidden state there and the token after
it. Its KV cache entry is kept true for every computed position: after each trunk step (a prefill chunk, or
a verify step's kept tokens) `catch_up` runs it over the same positions with the tokens shifted by one, so
the KV a later request reuses from the prefix cache is the one its own tokens give. That pass's output at a
decoding request's last position is its first draft; `extend` drafts the rest at the start of the next step
(after the scheduler reserved their positions' blocks), each from the MTP layer's own previous output, and
those speculative positions are rewritten by the next catch-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .request import Request
from .runner import ModelRunner


@dataclass
class CatchUp:
    """Trunk positions [start, start + num_tokens) of a request just computed: `hidden` [T, hidden] their
    normed hidden states (T >= num_tokens), `next_tokens` the token after each. `draft`: whether to keep
    the output at the last position as the request's first draft."""

    request: Request
    start: int
    next_tokens: Sequence[int]
    hidden: torch.Tensor
    draft: bool

    @property
    def num_tokens(self) -> int:
        return len(self.next_tokens)


class MTPDrafter:
    def __init__(
        self,
        runner: ModelRunner,
        num_speculative_tokens: int,
        block_table: Callable[[Request], torch.Tensor],
    ) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.block_table = block_table
        # The MTP layer's output at each drafting request's last draft: the hidden state of the next one.
        self._hidden: dict[str, torch.Tensor] = {}

    def catch_up(self, rows: Sequence[CatchUp]) -> None:
        """Run the MTP layer over the rows' positions (one call; rows padded to the longest)."""
        if not rows:
            return
        width = max(row.hidden.shape[0] for row in rows)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        hidden = rows[0].hidden.new_zeros((len(rows), width, rows[0].hidden.shape[-1]))
        for i, row in enumerate(rows):
            tokens[i, : row.num_tokens] = torch.as_tensor(list(row.next_tokens), dtype=torch.long)
            hidden[i, : row.hidden.shape[0]] = row.hidden
        logits, out = self.runner.draft(
            tokens,
            hidden,
            torch.tensor([row.start for row in rows]),
            torch.tensor([row.num_tokens for row in rows]),
            torch.stack([self.block_table(row.request) for row in rows]),
        )
        for i, row in enumerate(rows):
            if row.draft:
                row.request.draft_ids = [int(logits[i].argmax())]
                self._hidden[row.request.request_id] = out[i]
            else:
                row.request.draft_ids = []

    def extend(self, requests: Sequence[Request], num_drafts: dict[str, int]) -> None:
        """Draft each request's tokens 2..num_drafts[id] (its first came from `catch_up`); a request keeps
        only the drafts it will verify."""
        for request in requests:
            del request.draft_ids[num_drafts.get(request.request_id, 0) :]
        for count in range(2, self.num_speculative_tokens + 1):
            rows = [r for r in requests if num_drafts.get(r.request_id, 0) >= count]
            if not rows:
                return
            # Draft `count` comes from the MTP layer at the position of draft count - 1.
            logits, out = self.runner.draft(
                torch.tensor([[r.draft_ids[-1]] for r in rows]),
                torch.stack([self._hidden[r.request_id] for r in rows]),
                torch.tensor([r.num_computed + count - 2 for r in rows]),
                torch.ones(len(rows), dtype=torch.long),
                torch.stack([self.block_table(r) for r in rows]),
            )
            for i, request in enumerate(rows):
                request.draft_ids.append(int(logits[i].argmax()))
                self._hidden[request.request_id] = out[i]

    def forget(self, request: Request) -> None:
        self._hidden.pop(request.request_id, None)
        request.draft_ids.clear()
