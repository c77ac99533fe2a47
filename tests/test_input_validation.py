"""Bad token ids are refused at generate()'s boundary with a ValueError, before any backend sees them.

The cpu backend's compiled embedding aborts the whole process on an id out of range, so the same cases run
there in tests/test_export_cpu.py (`test_bad_token_ids_raise_instead_of_aborting`)."""

from __future__ import annotations

import pytest
import torch
from helpers import CountingBackend, export_eager

BAD_TOKEN_IDS = {
    "id equal to vocab_size": (torch.tensor([[1, 2, 512]]), "input_ids\\[0, 2\\] = 512 is not a token"),
    "negative id": (torch.tensor([[1, -1, 3]]), "input_ids\\[0, 1\\] = -1 is not a token"),
    "float ids": (torch.tensor([[1.0, 2.7]]), "must hold integer token ids"),
    "bool ids": (torch.tensor([[True, False]]), "must hold integer token ids"),
    "3-d ids": (torch.ones((1, 2, 2), dtype=torch.long), "must be \\[batch, length\\]"),
    "empty ids": (torch.ones((1, 0), dtype=torch.long), "must be \\[batch, length\\]"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from conftest import save_tiny_checkpoint

    path, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("ids") / "ckpt", "causal", seed=2)
    return export_eager(path, batch_size=2, sequence_length=64)


@pytest.mark.parametrize("case", list(BAD_TOKEN_IDS))
def test_bad_token_ids_are_refused_before_the_backend_runs(model, case: str) -> None:
    ids, message = BAD_TOKEN_IDS[case]
    engine = model.generation_engine()
    counting = CountingBackend(engine.runner.backend)
    engine.runner.backend = counting
    try:
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=2, do_sample=False)
    finally:
        engine.runner.backend = counting.backend
    assert counting.prefill_tokens == 0 and counting.decode_steps == 0


def test_pad_token_outside_the_vocabulary_is_refused(model) -> None:
    # Finished rows keep decoding on the pad token, so it is fed to the model too.
    with pytest.raises(ValueError, match="pad_token_id=600 is not a token"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=2, pad_token_id=600, do_sample=False)


def test_integer_ids_of_any_integer_type_or_a_list_are_accepted(model) -> None:
    want = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    for ids in (torch.tensor([[5, 6, 7]], dtype=torch.int32), [[5, 6, 7]], [5, 6, 7]):
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want)
