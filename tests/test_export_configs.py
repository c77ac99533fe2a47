"""Awkward configurations on every backend, against transformers, and compiled graphs reused across
checkpoints: graphs compiled for one checkpoint and bound to another checkpoint's weights (through the
local compile cache and through a Hub cache repository) compute that checkpoint's logits.

fp32 throughout: logits within 1e-4 of each step's largest logit, exact greedy tokens (a row may diverge
only after a near-tie of the reference). Two compiled exports (about 1.5 minutes each on 2 cores) serve
every compiled case here; eager runs the whole grid, in both checkpoint layouts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import save_tiny_checkpoint
from helpers import StubHubRepo, assert_greedy_matches_reference, left_padded_prompts

from optimum_qwen36 import NeuronQwen36ForCausalLM
from optimum_qwen36.exporters import regions
from optimum_qwen36.exporters.compile_cache import CompileCache, HubCompileCache

BACKEND = os.environ.get("OPTIMUM_QWEN36_TEST_BACKEND", "cpu")
COMPILED_AVAILABLE = BACKEND == "cpu" or torch.cuda.is_available()
LINEAR, FULL = "linear_attention", "full_attention"
NEW_TOKENS = 32

# name -> (config overrides, export settings, prompt lengths of one left-padded batch)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], list[int]]] = {
    # head_dim 40 (not a multiple of 16), GDN K 24 != V 20, 3 key / 6 value heads (HV/H = 2), 3 query heads
    # over 1 KV head, untied, the pattern ends on a GDN layer; the default prefill chunk is the whole
    # sequence_length, 120, not a multiple of 64 (nor of the GDN twin's 32-token tile).
    "head-dim-40-k24-v20-odd-heads-untied": (
        dict(
            head_dim=40,
            num_attention_heads=3,
            num_key_value_heads=1,
            linear_num_key_heads=3,
            linear_num_value_heads=6,
            linear_key_head_dim=24,
            linear_value_head_dim=20,
            num_hidden_layers=6,
            layer_types=[LINEAR, FULL, LINEAR, LINEAR, FULL, LINEAR],
            tie_word_embeddings=False,
        ),
        dict(sequence_length=120),
        [7, 30, 57],
    ),
    # HV/H = 3, tied embeddings, 5 query heads over 5 KV heads (no grouping), head_dim 24, the pattern starts
    # on attention and ends on GDN; a 24-token prefill chunk, so the longest prompt spans three chunks.
    "ratio-3-tied-mha-head-dim-24": (
        dict(
            head_dim=24,
            num_attention_heads=5,
            num_key_value_heads=5,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_hidden_layers=5,
            layer_types=[FULL, LINEAR, LINEAR, LINEAR, LINEAR],
            tie_word_embeddings=True,
        ),
        dict(sequence_length=128, prefill_chunk_size=24),
        [5, 24, 61],
    ),
}
BATCH = 3


def export(path: Path, backend: str, settings: dict[str, Any], **kwargs: Any) -> NeuronQwen36ForCausalLM:
    return NeuronQwen36ForCausalLM.from_pretrained(
        path, export=True, backend=backend, batch_size=BATCH, dtype="float32", **settings, **kwargs
    )


def greedy(model: Any, lengths: list[int], **kwargs: Any) -> Any:
    """Greedy generation of one left-padded batch, with the logits of every step."""
    input_ids, mask = left_padded_prompts(lengths, seed=1)
    return model.generate(
        input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
        return_dict_in_generate=True, output_logits=True, **kwargs,
    )  # fmt: skip


def checkpoint_of(root: Path, name: str, layout: str, seed: int) -> tuple[Path, torch.nn.Module]:
    return save_tiny_checkpoint(root / f"{name}-{layout}-{seed}", layout, seed, **CONFIGS[name][0])


@pytest.mark.parametrize("layout", ["causal", "conditional"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_matches_transformers(tmp_path: Path, name: str, layout: str) -> None:
    _, settings, lengths = CONFIGS[name]
    path, reference = checkpoint_of(tmp_path, name, layout, seed=3)
    ours = greedy(export(path, "eager", settings), lengths)
    assert_greedy_matches_reference(ours, greedy(reference, lengths, pad_token_id=0), what="transformers")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per configuration: a checkpoint, its export on the compiled backend (compiled once, into a local
    compile cache that a stub Hub repository also receives), and where those graphs are."""
    if not COMPILED_AVAILABLE:
        pytest.skip(f"the {BACKEND} backend needs a GPU")
    root = tmp_path_factory.mktemp("configs")
    exports = {}
    for name, (_, settings, _) in CONFIGS.items():
        path, reference = checkpoint_of(root, name, "causal", seed=11)
        cache_dir, hub = root / f"{name}-cache", StubHubRepo(root / f"{name}-hub")
        graphs = HubCompileCache("me/cache", cache_dir, api=hub, trust_compiled_code=True)
        neuron_config = NeuronQwen36ForCausalLM.get_neuron_config(
            path, backend=BACKEND, batch_size=BATCH, dtype="float32", **settings
        )
        model = NeuronQwen36ForCausalLM.export(path, neuron_config, compile_cache=graphs)
        exports[name] = dict(path=path, reference=reference, model=model, cache_dir=cache_dir, hub=hub)
    return exports


@pytest.fixture
def no_compilation(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("compiled although the graphs should have been reused")

    monkeypatch.setattr(regions, "CompilePool", refuse)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_matches_transformers_and_eager(compiled: dict, name: str) -> None:
    _, settings, lengths = CONFIGS[name]
    case = compiled[name]
    assert case["model"].backend.name == BACKEND
    ours = greedy(case["model"], lengths)
    transformers_out = greedy(case["reference"], lengths, pad_token_id=0)
    assert_greedy_matches_reference(ours, transformers_out, what="transformers")
    assert_greedy_matches_reference(
        ours, greedy(export(case["path"], "eager", settings), lengths), what="eager"
    )


@pytest.mark.parametrize("through", ["local cache", "hub cache"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_graphs_compiled_for_another_checkpoint_compute_this_ones_logits(
    compiled: dict, tmp_path: Path, no_compilation: None, name: str, through: str, monkeypatch
) -> None:
    """The same architecture saved in the other layout with other weights (as Qwen3.5-27B and Qwen3.6-27B,
    or two fine-tunes): its export reuses the graphs and must give its own eager logits, not the first
    checkpoint's."""
    _, settings, lengths = CONFIGS[name]
    case = compiled[name]
    other, _ = checkpoint_of(tmp_path, name, "conditional", seed=12)
    if through == "local cache":
        cache = CompileCache(case["cache_dir"])
    else:  # an empty local cache backed by the repository the first export uploaded to
        cache = HubCompileCache("me/cache", tmp_path / "empty", api=case["hub"], trust_compiled_code=True)
    neuron_config = NeuronQwen36ForCausalLM.get_neuron_config(
        other, backend=BACKEND, batch_size=BATCH, dtype="float32", **settings
    )
    calls_before = len(case["hub"].calls)
    reused = NeuronQwen36ForCausalLM.export(other, neuron_config, compile_cache=cache)
    downloads = [name for name, _ in case["hub"].calls[calls_before:] if name == "snapshot_download"]
    assert downloads == (["snapshot_download"] if through == "hub cache" else [])
    eager = greedy(export(other, "eager", settings), lengths)
    ours = greedy(reused, lengths)
    assert_greedy_matches_reference(ours, eager, what="eager")
    # The two checkpoints really differ: a graph computing with the first one's weights would fail above.
    first = greedy(case["model"], lengths)
    assert not torch.equal(first.sequences, ours.sequences)


def test_compiling_refuses_graphs_that_hold_weight_values(tmp_path: Path) -> None:
    """Inductor writes the values of short 1-d and 0-d weights into the code unless told not to; the
    exporter checks every compiled graph for that, so no such graph is stored in a compile cache."""
    from optimum_qwen36.exporters.aoti import BakedInTensorError, compile_method

    class Decay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.tensor([0.5, 1.0, 2.0]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * -self.A_log.exp()

    x = torch.ones(4, 3)
    bound = compile_method(Decay(), "forward", (x,), tmp_path / "kept.pt2")
    assert set(bound) == {"A_log"}
    with pytest.raises(BakedInTensorError, match="A_log"):
        compile_method(
            Decay(), "forward", (x,), tmp_path / "inlined.pt2",
            inductor_configs={"always_keep_tensor_constants": False},
        )  # fmt: skip
