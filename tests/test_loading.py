"""Checkpoint loading, export settings, save/load round trip and push_to_hub (eager backend)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import export_eager, left_padded_prompts
from safetensors.torch import load_file, save_file

from optimum_qwen36 import NeuronModelForCausalLM, NeuronQwen36ForCausalLM, Qwen36NeuronConfig
from optimum_qwen36.network.weights import CheckpointError


def _rewrite_weights(path: Path, edit) -> None:
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    edit(tensors)
    save_file(tensors, weights_file, metadata={"format": "pt"})


def test_missing_tensor_is_reported(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    _rewrite_weights(path, lambda t: t.pop("model.layers.0.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.0\.linear_attn\.A_log"):
        export_eager(path)


def test_unexpected_tensor_is_reported(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected model\.layers\.0\.mystery\.weight"):
        export_eager(path)


def test_misshaped_tensor_is_reported(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.zeros(63)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(63,\).*\(64,\)"):
        export_eager(path)


def test_pickled_weights_are_refused(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    os.replace(path / "model.safetensors", path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        export_eager(path)


def test_foreign_model_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"runs Qwen3\.5/Qwen3\.6 checkpoints"):
        export_eager(tmp_path)


def test_sharded_checkpoint_loads(tiny_checkpoint, tmp_path: Path) -> None:
    path, reference = tiny_checkpoint("conditional", seed=2)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt, _ = left_padded_prompts([12], seed=1)
    a = export_eager(path, batch_size=1).generate(prompt, max_new_tokens=8, do_sample=False)
    b = export_eager(sharded, batch_size=1).generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)


def test_neuron_config_validation() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        Qwen36NeuronConfig(batch_size=0)
    with pytest.raises(ValueError, match="Unsupported dtype"):
        Qwen36NeuronConfig(dtype="int8")
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        Qwen36NeuronConfig(sequence_length=128, prefill_chunk_size=256)
    # Refused when the config is built, not at export.
    with pytest.raises(ValueError, match="the 'cuda' backend does not run sharded graphs"):
        Qwen36NeuronConfig(tp_degree=2, backend="cuda")
    with pytest.raises(ValueError, match="Unknown backend"):
        Qwen36NeuronConfig(backend="tpu")
    with pytest.raises(ValueError, match="written by a newer version"):
        Qwen36NeuronConfig.from_dict({"batch_size": 1, "from_the_future": True})
    # Earlier versions wrote the (always float32) recurrent state dtype.
    assert Qwen36NeuronConfig.from_dict({"recurrent_state_dtype": "float32"}) == Qwen36NeuronConfig()
    with pytest.raises(ValueError, match="always float32"):
        Qwen36NeuronConfig.from_dict({"recurrent_state_dtype": "bfloat16"})
    assert Qwen36NeuronConfig(dtype=torch.bfloat16).dtype == "bfloat16"


def test_get_neuron_config_defaults_from_checkpoint(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    neuron_config = NeuronQwen36ForCausalLM.get_neuron_config(path, batch_size=2, sequence_length=128)
    assert neuron_config.batch_size == 2
    assert neuron_config.prefill_chunk_size == 128
    assert neuron_config.dtype == "float32"  # the checkpoint's dtype
    assert neuron_config.checkpoint_id == str(path)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        export_eager(path, sequence_length=8192)


def test_save_and_reload_generates_the_same_tokens(tiny_checkpoint, tmp_path: Path) -> None:
    path, _ = tiny_checkpoint("conditional", seed=5, tie_word_embeddings=True)
    model = export_eager(path)
    saved = tmp_path / "exported"
    model.save_pretrained(saved)
    names = set(os.listdir(saved))
    assert {"config.json", "neuron_config.json", "generation_config.json", "model.safetensors"} <= names
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names  # the shipped tokenizer
    # The base class dispatches on the saved config's model_type.
    reloaded = NeuronModelForCausalLM.from_pretrained(saved)
    assert isinstance(reloaded, NeuronQwen36ForCausalLM)
    assert reloaded.neuron_config == model.neuron_config
    input_ids, mask = left_padded_prompts([7, 3, 12], seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(input_ids, **kwargs), reloaded.generate(input_ids, **kwargs))
    with pytest.raises(ValueError, match="only apply with export=True"):
        NeuronQwen36ForCausalLM.from_pretrained(saved, batch_size=4)
    # Prefix caching does not change the compiled graphs: it can be switched on when loading.
    with_cache = NeuronQwen36ForCausalLM.from_pretrained(saved, prefix_caching=True, prefix_cache_bytes=2**24)
    assert with_cache.prefix_cache is not None and with_cache.neuron_config.prefix_cache_bytes == 2**24
    assert torch.equal(with_cache.generate(input_ids, **kwargs), reloaded.generate(input_ids, **kwargs))


def test_loading_an_unexported_directory_explains_what_to_do(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("causal")
    with pytest.raises(FileNotFoundError, match="export=True"):
        NeuronQwen36ForCausalLM.from_pretrained(path)


def test_push_to_hub_uploads_the_saved_folder(tiny_checkpoint, tmp_path: Path) -> None:
    path, _ = tiny_checkpoint("causal")
    model = export_eager(path, batch_size=1)
    model.save_pretrained(tmp_path / "out")
    calls: list[tuple[str, dict]] = []

    class FakeHub:
        def create_repo(self, repo_id: str, **kwargs) -> None:
            calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

        def create_branch(self, repo_id: str, **kwargs) -> None:
            calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

        def upload_folder(self, **kwargs) -> str:
            calls.append(("upload_folder", kwargs))
            return "https://hub.example/commit/1"

    url = model.push_to_hub(tmp_path / "out", "me/tiny-qwen36", private=True, revision="v1", api=FakeHub())
    assert url == "https://hub.example/commit/1"
    assert [c[0] for c in calls] == ["create_repo", "create_branch", "upload_folder"]
    assert calls[0][1]["repo_id"] == "me/tiny-qwen36" and calls[0][1]["private"] is True
    assert calls[2][1]["folder_path"] == str(tmp_path / "out") and calls[2][1]["revision"] == "v1"


def test_hub_id_is_downloaded_with_safetensors_patterns(tiny_checkpoint, monkeypatch) -> None:
    path, _ = tiny_checkpoint("causal")
    requests: list[dict] = []

    def fake_snapshot_download(repo_id: str, **kwargs) -> str:
        requests.append({"repo_id": repo_id, **kwargs})
        return str(path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    model = NeuronQwen36ForCausalLM.from_pretrained(
        "someone/tiny-qwen36",
        export=True,
        revision="main",
        backend="eager",
        batch_size=1,
        sequence_length=64,
        dtype="float32",
    )
    assert model.neuron_config.checkpoint_id == "someone/tiny-qwen36"
    assert requests[0]["repo_id"] == "someone/tiny-qwen36" and requests[0]["revision"] == "main"
    assert "*.safetensors" in requests[0]["allow_patterns"] and "*.bin" not in requests[0]["allow_patterns"]

    def offline(repo_id: str, **kwargs) -> str:
        raise ConnectionError("no network")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(OSError, match="neither a local directory nor a Hub repository"):
        NeuronQwen36ForCausalLM.from_pretrained("someone/tiny-qwen36", export=True)


@pytest.mark.parametrize(("flags", "warned"), [({"avx2", "fma"}, True), ({"avx2", "avx512_bf16"}, False)])
def test_bf16_export_warns_on_a_cpu_without_bf16_matrix_instructions(
    tiny_checkpoint,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    flags: set,
    warned: bool,
) -> None:
    """The eager backend runs ATen's bf16 products as they are (the cpu backend widens prefill's)."""
    from optimum_qwen36.ops import native

    path, _ = tiny_checkpoint("causal")
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.WARNING):
        export_eager(path, dtype="bfloat16", batch_size=1, sequence_length=64)
    assert ("dtype='float32'" in caplog.text) is warned
