"""Artifact manifest (hashes, versions, ISA, tp degree), model card and compile cache: no compilation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from optimum_qwen36 import Qwen36NeuronConfig
from optimum_qwen36.exporters import artifact, compile_cache
from optimum_qwen36.exporters.compile_cache import CompileCache, compile_key, default_cache_dir


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    (tmp_path / "compiled").mkdir()
    (tmp_path / "compiled" / "decode_step.pt2").write_bytes(b"native code")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    artifact.write_manifest(tmp_path, "cpu", 1)
    return tmp_path


def _edit_manifest(directory: Path, **changes) -> None:
    path = directory / artifact.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if key in manifest["environment"]:
            manifest["environment"][key] = value
        else:
            manifest[key] = value
    path.write_text(json.dumps(manifest))


def test_manifest_lists_every_file_and_verifies(saved: Path) -> None:
    manifest = artifact.verify_artifact(saved, "cpu", 1)
    assert set(manifest["files"]) == {"compiled/decode_step.pt2", "model.safetensors", "config.json"}
    assert manifest["environment"]["cpu_isa"] == artifact.cpu_isa()


def test_tampered_missing_and_unlisted_files_are_refused(saved: Path) -> None:
    (saved / "compiled" / "decode_step.pt2").write_bytes(b"other code")
    with pytest.raises(artifact.ArtifactIntegrityError, match="sha256"):
        artifact.verify_artifact(saved, "cpu", 1)
    (saved / "compiled" / "decode_step.pt2").unlink()
    with pytest.raises(artifact.ArtifactIntegrityError, match="missing"):
        artifact.verify_artifact(saved, "cpu", 1)
    artifact.write_manifest(saved, "cpu", 1)
    (saved / "compiled" / "extra.so").write_bytes(b"injected")
    with pytest.raises(artifact.ArtifactIntegrityError, match="not in"):
        artifact.verify_artifact(saved, "cpu", 1)


def test_no_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(artifact.ArtifactIntegrityError, match="Re-export"):
        artifact.verify_artifact(tmp_path, "cpu", 1)


@pytest.mark.parametrize("key", ["torch", "compiler", "optimum_qwen36"])
def test_other_versions_are_refused(saved: Path, key: str) -> None:
    _edit_manifest(saved, **{key: "0.0.1"})
    with pytest.raises(artifact.ArtifactVersionError, match="re-export"):
        artifact.verify_artifact(saved, "cpu", 1)


def test_graphs_compiled_with_the_native_kernels_need_them_here(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs traced with the native kernels' custom ops cannot run where the kernels cannot be built: a
    clear error at load, not an unknown operator at the first call. Artifacts from before the field load."""
    _edit_manifest(saved, native_ops=True)
    monkeypatch.setattr(artifact, "load_native_ops", lambda: False)
    with pytest.raises(artifact.ArtifactVersionError, match="native CPU kernels"):
        artifact.verify_artifact(saved, "cpu", 1)
    path = saved / artifact.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    del manifest["environment"]["native_ops"]
    path.write_text(json.dumps(manifest))
    artifact.verify_artifact(saved, "cpu", 1)


def test_a_neuron_artifact_is_refused_after_a_torch_neuronx_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch pins the torch-neuronx family (2.13.x / 2.14.x), not its release: that is recorded too."""
    monkeypatch.setattr(artifact, "_distribution_version", lambda name: "2.14.3.0.1")
    (tmp_path / "compiled").mkdir()
    (tmp_path / "compiled" / "step.neff").write_bytes(b"native code")
    manifest = artifact.write_manifest(tmp_path, "neuron", 1)
    assert manifest["environment"]["torch_neuronx"] == "2.14.3.0.1"
    artifact.verify_artifact(tmp_path, "neuron", 1)
    monkeypatch.setattr(artifact, "_distribution_version", lambda name: "2.14.3.0.2")
    with pytest.raises(artifact.ArtifactVersionError, match=r"torch_neuronx '2\.14\.3\.0\.1'"):
        artifact.verify_artifact(tmp_path, "neuron", 1)


def test_missing_cpu_isa_is_refused(saved: Path) -> None:
    absent = [flag for flag in artifact.ISA_FLAGS if flag not in artifact.cpu_isa()]
    if not absent:
        pytest.skip("this CPU has every ISA extension the check knows")
    _edit_manifest(saved, cpu_isa=[*artifact.cpu_isa(), absent[0]])
    with pytest.raises(artifact.ArtifactISAError, match=absent[0]):
        artifact.verify_artifact(saved, "cpu", 1)


def test_wrong_tp_degree_and_backend_are_refused(saved: Path) -> None:
    with pytest.raises(artifact.ArtifactTopologyError, match="tp_degree=1"):
        artifact.verify_artifact(saved, "cpu", 2)
    _edit_manifest(saved, tp_degree=4)
    with pytest.raises(artifact.ArtifactTopologyError, match="tp_degree=4"):
        artifact.verify_artifact(saved, "cpu", 1)
    with pytest.raises(artifact.ArtifactTopologyError, match="'cpu' backend"):
        artifact.check_environment(artifact.read_manifest(saved), "cuda", 4)


def test_model_card_has_hub_metadata_and_settings(tmp_path: Path) -> None:
    config = Qwen36NeuronConfig(backend="cpu", sequence_length=512, checkpoint_id="Qwen/Qwen3.6-27B")
    artifact.write_model_card(tmp_path, config, repository_id="me/qwen36-cpu")
    card = (tmp_path / "README.md").read_text()
    front_matter = card.split("---")[1]
    assert "library_name: optimum-qwen36" in front_matter
    assert "base_model: Qwen/Qwen3.6-27B" in front_matter
    assert "- cpu" in front_matter
    assert "| `sequence_length` | `512` |" in card
    assert 'from_pretrained("me/qwen36-cpu", trust_compiled_code=True)' in card


def test_model_card_omits_base_model_for_local_paths(tmp_path: Path) -> None:
    config = Qwen36NeuronConfig(backend="eager", checkpoint_id=str(tmp_path))
    artifact.write_model_card(tmp_path, config)
    assert "base_model" not in (tmp_path / "README.md").read_text()


def test_compile_key_ignores_the_checkpoint_but_not_shapes() -> None:
    model = {"hidden_size": 64, "_name_or_path": "a"}
    settings = Qwen36NeuronConfig(backend="cpu", sequence_length=256, checkpoint_id="x").to_dict()
    key = compile_key(model, settings, "cpu")
    assert key == compile_key({**model, "_name_or_path": "b"}, {**settings, "checkpoint_id": "y"}, "cpu")
    assert key != compile_key(model, {**settings, "sequence_length": 512}, "cpu")
    assert key != compile_key({**model, "hidden_size": 128}, settings, "cpu")
    # Prefix caching only resizes the KV block pool, a dynamic dimension of the graphs.
    assert key == compile_key(model, {**settings, "prefix_caching": True, "prefix_cache_bytes": 1}, "cpu")


def test_compile_key_changes_with_the_graph_source(monkeypatch: pytest.MonkeyPatch) -> None:
    model = {"hidden_size": 64}
    settings = Qwen36NeuronConfig(backend="cpu", sequence_length=256).to_dict()
    key = compile_key(model, settings, "cpu")
    monkeypatch.setattr(compile_cache, "graph_source_digest", lambda: "edited model code")
    assert compile_key(model, settings, "cpu") != key


def test_the_graph_source_covers_every_module_the_model_imports() -> None:
    """Every op module the model's code has loaded (attention, conv, GDN, FP8, the NKI kernels' PyTorch
    twins) is part of the compile key's graph source: editing any of them recompiles."""
    from optimum_qwen36.network import model  # noqa: F401  (loads the ops it calls)

    hashed = {path.resolve() for path in compile_cache.graph_sources()}
    ops = [
        module
        for name, module in sys.modules.items()
        if name.startswith("optimum_qwen36.ops.")
        or (name.startswith("optimum_qwen36.nki.kernels.") and name.endswith("_torch"))
    ]
    assert any(module.__name__ == "optimum_qwen36.ops.conv" for module in ops)
    for module in ops:
        assert Path(module.__file__).resolve() in hashed, f"{module.__name__} is not in the compile key"


def test_compile_cache_store_lookup_corrupt_and_clear(tmp_path: Path) -> None:
    source = tmp_path / "graphs"
    source.mkdir()
    (source / "decode_step.pt2").write_bytes(b"code")
    cache = CompileCache(tmp_path / "cache")
    assert cache.lookup("k1") is None
    entry = cache.store("k1", source, {"backend": "cpu"})
    assert cache.lookup("k1") == entry
    assert (entry / "decode_step.pt2").read_bytes() == b"code"
    assert [e["description"] for e in cache.entries()] == [{"backend": "cpu"}]
    (entry / "decode_step.pt2").write_bytes(b"corrupted")
    assert cache.lookup("k1") is None  # a corrupt entry is a miss, and is removed
    cache.store("k2", source, {})
    assert cache.clear() == 1
    assert cache.entries() == []


def test_compile_cache_keeps_an_entry_another_process_stored_meanwhile(tmp_path: Path) -> None:
    """Tensor-parallel ranks (processes) may store the same key: the first entry stays, being read."""
    cache = CompileCache(tmp_path / "cache")
    first, second = tmp_path / "first", tmp_path / "second"
    for source, code in ((first, b"rank 0"), (second, b"rank 1")):
        source.mkdir()
        (source / "decode_step.pt2").write_bytes(code)
    entry = cache.store("k1", first, {})
    assert cache.store("k1", second, {}) == entry
    assert (entry / "decode_step.pt2").read_bytes() == b"rank 0"
    assert [p.name for p in cache.root.iterdir()] == ["k1"]  # no staging directory left behind


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPTIMUM_QWEN36_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("OPTIMUM_QWEN36_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "optimum-qwen36"
