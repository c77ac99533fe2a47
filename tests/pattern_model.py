"""A tiny model trained in seconds to be decisive, for bf16 accuracy (tests/test_export_bf16.py asserts the
tolerance, benchmarks/bf16_accuracy.py records the figures of docs/EXPORT.md).

A random tiny model has nearly flat logits (top-2 gaps far below bf16's rounding), so its greedy tokens flip
on any reordering of the arithmetic and a greedy match rate says nothing. This model is trained for a few
dozen steps on a repeating pattern whose next token depends on the two before it (each token occurs twice in
the period, with different successors), so every layer takes part and the logits are decisive.
"""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import save_tiny_checkpoint

SETTINGS = dict(batch_size=3, sequence_length=96, prefill_chunk_size=16, dtype="bfloat16")
PROMPT_LENGTHS = [5, 21, 37]  # within one chunk, across two, across three
NEW_TOKENS = 32
PERIOD_TOKENS = 32
TRAIN_STEPS = 80


def _pattern() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randperm(511, generator=generator)[:PERIOD_TOKENS] + 1  # never the pad token 0
    return torch.cat([tokens, tokens[torch.randperm(PERIOD_TOKENS, generator=generator)]])


PATTERN = _pattern()


def windows(starts: torch.Tensor, length: int) -> torch.Tensor:
    return PATTERN[(starts[:, None] + torch.arange(length)[None]) % len(PATTERN)]


def train_pattern_checkpoint(directory: Path) -> tuple[Path, torch.nn.Module]:
    """A tiny transformers model trained to continue PATTERN, saved in fp32; returns (dir, fp32 model)."""
    _, model = save_tiny_checkpoint(directory, "causal", seed=3)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=TRAIN_STEPS)
    model.train()
    for _ in range(TRAIN_STEPS):
        batch = windows(torch.randint(0, len(PATTERN), (8,), generator=generator), 32)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    model.eval().requires_grad_(False)
    model.save_pretrained(directory)
    return directory, model


def pattern_prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded windows of the pattern, and the tokens that continue each."""
    width = max(PROMPT_LENGTHS)
    input_ids = torch.zeros((len(PROMPT_LENGTHS), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    expected = []
    for row, length in enumerate(PROMPT_LENGTHS):
        start = torch.tensor([17 * row + 3])
        input_ids[row, width - length :] = windows(start, length)[0]
        mask[row, width - length :] = 1
        expected.append(windows(start + length, NEW_TOKENS)[0])
    return input_ids, mask, torch.stack(expected)


def generate_tokens_and_logits(model, one_row_at_a_time: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(new tokens [rows, NEW_TOKENS], fp32 logits [rows, NEW_TOKENS, vocab]); the prompts in one batch, or
    each alone (the compiled backend then decodes with its one-row graph)."""
    input_ids, mask, _ = pattern_prompts()
    if one_row_at_a_time:
        rows = [generate_rows(model, input_ids[i : i + 1], mask[i : i + 1]) for i in range(len(input_ids))]
        return torch.cat([tokens for tokens, _ in rows]), torch.cat([logits for _, logits in rows])
    return generate_rows(model, input_ids, mask)


def generate_rows(model, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    if isinstance(model, torch.nn.Module):
        kwargs["pad_token_id"] = 0
    with torch.no_grad():
        out = model.generate(input_ids, **kwargs)
    return out.sequences[:, input_ids.shape[1] :], torch.stack(out.logits, dim=1).float()


def compare(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Greedy match rate over the new tokens, and max |logit difference| over the steps up to and including
    each row's first mismatch (after it, the rows continue different sequences)."""
    tokens, logits = ours
    other_tokens, other_logits = theirs
    same = tokens == other_tokens
    diffs = []
    for row in range(tokens.shape[0]):
        mismatches = (~same[row]).nonzero()
        steps = NEW_TOKENS if len(mismatches) == 0 else int(mismatches[0]) + 1
        diffs.append((logits[row, :steps] - other_logits[row, :steps]).abs().max())
    return {"greedy_match": same.float().mean().item(), "max_logit_diff": torch.stack(diffs).max().item()}
