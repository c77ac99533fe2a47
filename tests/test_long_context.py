"""Long context on a tiny model: a 16K-token prompt on eager and on the compiled backend matches
transformers, and prefix-cache reuse at 16K gives the cold run's tokens and logits.

Nothing in the chunked design is bounded by a prefix bucket: a prompt is any number of prefill chunks
over the paged KV cache. Each test compares the logits of the last 64 positions: the prompt minus its
last 64 tokens is prefilled, then those 64 tokens are fed one decode step at a time (forced through a
logits processor; `output_logits` keeps the raw logits of every step)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import save_tiny_checkpoint

from optimum_qwen36 import NeuronQwen36ForCausalLM

pytestmark = pytest.mark.slow

LENGTH = 16384
TAIL = 64  # positions whose logits are compared
SETTINGS = dict(batch_size=1, sequence_length=LENGTH + 64, prefill_chunk_size=512, dtype="float32")
BACKEND = os.environ.get("OPTIMUM_QWEN36_TEST_BACKEND", "cpu")


@pytest.fixture(scope="module")
def long_prompt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny checkpoint that knows 32K positions, a 16K-token sequence, and transformers' logits at the
    last TAIL positions (each predicting the next token of the sequence)."""
    path, reference = save_tiny_checkpoint(
        tmp_path_factory.mktemp("long") / "ckpt", "causal", seed=21, max_position_embeddings=32768
    )
    sequence = torch.randint(1, 512, (1, LENGTH), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = reference(sequence, logits_to_keep=TAIL + 1).logits[0, :-1].float()
    return dict(path=path, sequence=sequence, reference_logits=logits)


class ForceTokens:
    """A logits processor that makes generate() pick the given tokens, one per step."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens.tolist()
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[self.step]] = 0.0
        self.step += 1
        return forced


def tail_logits(model: NeuronQwen36ForCausalLM, sequence: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Our logits at the last TAIL positions of `sequence`: [TAIL, vocab], and the generate() output."""
    prompt, tail = sequence[:, :-TAIL], sequence[0, -TAIL:]
    out = model.generate(
        prompt, max_new_tokens=TAIL, do_sample=False, logits_processor=[ForceTokens(tail)],
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, sequence)
    return torch.cat(out.logits), out


def assert_close_to_largest(ours: torch.Tensor, theirs: torch.Tensor, rel_tol: float = 1e-4) -> None:
    tolerance = rel_tol * float(theirs.abs().max())
    diff = float((ours - theirs).abs().max())
    assert diff <= tolerance, f"max |logit diff| {diff:.3g} > {tolerance:.3g}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("backend", ["eager", BACKEND])
def test_16k_prompt_matches_transformers(long_prompt: dict[str, Any], backend: str, tmp_path: Path) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = NeuronQwen36ForCausalLM.from_pretrained(
        long_prompt["path"], export=True, backend=backend, compile_cache_dir=tmp_path, **SETTINGS
    )
    ours, _ = tail_logits(model, long_prompt["sequence"])
    assert_close_to_largest(ours, long_prompt["reference_logits"])


def test_prefix_cache_reuse_at_16k_equals_the_cold_run(long_prompt: dict[str, Any], tmp_path: Path) -> None:
    path, sequence = long_prompt["path"], long_prompt["sequence"]
    cold, _ = tail_logits(
        NeuronQwen36ForCausalLM.from_pretrained(path, export=True, backend="eager", **SETTINGS), sequence
    )
    model = NeuronQwen36ForCausalLM.from_pretrained(
        path, export=True, backend="eager", prefix_caching=True, **SETTINGS
    )
    first, out = tail_logits(model, sequence)
    assert out.cached_tokens.tolist() == [0]
    warm, out = tail_logits(model, sequence)
    # The prompt (16K - 64 tokens, a multiple of the 64-token granularity) is reused but for its last
    # 64-token granule: the last prompt token is always run for its logits, and checkpoints sit on granules.
    assert out.cached_tokens.tolist() == [LENGTH - TAIL - 64]
    # fp32: the same greedy tokens and logits within 1e-4 of the largest (bitwise equal on the machine this
    # was written on; another summation order in another BLAS may differ in the last bits).
    assert_close_to_largest(first, cold)
    assert_close_to_largest(warm, cold)
