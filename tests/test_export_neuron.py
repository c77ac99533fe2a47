"""The neuron backend's wiring, without the Neuron SDK: the error that says what to install, and (against
a stand-in torch_neuronx and torch.compile) the compile options, NEFF cache location and warm-up."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import export_eager, left_padded_prompts

from optimum_qwen36 import NeuronQwen36ForCausalLM, Qwen36NeuronConfig
from optimum_qwen36.exporters import neuron


def test_missing_sdk_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # makes the import fail
    with pytest.raises(neuron.NeuronSDKUnavailableError) as error:
        neuron.require_torch_neuronx()
    assert "pip.repos.neuron.amazonaws.com" in str(error.value)
    assert "backend='cpu'" in str(error.value)


def test_export_with_neuron_backend_fails_clearly_without_sdk(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    path, _ = tiny_checkpoint("causal", seed=3)
    with pytest.raises(neuron.NeuronSDKUnavailableError, match="AWS Neuron"):
        NeuronQwen36ForCausalLM.from_pretrained(
            path, export=True, backend="neuron", sequence_length=64, dtype="float32", prefill_chunk_size=16
        )


def test_wiring_against_a_stand_in_sdk(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setenv(neuron.NEURON_CACHE_ENV, "restored after the test")
    compiled, runs = [], []

    def fake_compile(fn, **options):
        compiled.append((fn.__name__, options))

        def run(*args):  # the stand-in "device" is the CPU: run the step eagerly
            runs.append(fn.__name__)
            return fn(*args)

        return run

    path, _ = tiny_checkpoint("causal", seed=3)
    reference = export_eager(path, batch_size=2, sequence_length=64)
    nc = Qwen36NeuronConfig(
        backend="neuron", batch_size=2, sequence_length=64, prefill_chunk_size=16, dtype="float32"
    )
    backend = neuron.NeuronBackend(
        reference.model,
        nc,
        lambda device: NeuronQwen36ForCausalLM.cache_for(reference.config, nc, device),
        compile_fn=fake_compile,
        device="cpu",
    )
    expected = dict(backend="neuron", fullgraph=True, dynamic=False)
    assert compiled == [("prefill_chunk", expected), ("decode_step", expected)]
    assert runs == ["prefill_chunk", "decode_step"]  # warm-up: the NEFFs are built at export
    # The compiler's cache points at the backend's directory, which save() copies into the artifact.
    assert os.environ[neuron.NEURON_CACHE_ENV] == str(backend.cache_dir)
    (backend.cache_dir / "graph.neff").write_bytes(b"neff")
    backend.save(tmp_path)
    assert (tmp_path / "compiled" / neuron.NEURON_CACHE_DIR / "graph.neff").read_bytes() == b"neff"

    ids, mask = left_padded_prompts([5, 9], seed=1)
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    reference.backend = backend
    assert torch.equal(reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), want)


def test_tensor_parallel_neuron_is_refused_until_implemented(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    nc = Qwen36NeuronConfig(backend="neuron", tp_degree=2, sequence_length=64, prefill_chunk_size=16)
    with pytest.raises(NotImplementedError, match="tp_degree=1"):
        neuron.NeuronBackend(None, nc, lambda device: None, compile_fn=lambda fn, **_: fn)
