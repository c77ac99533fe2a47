"""The Hub compile-cache repository against an offline stub client: what is uploaded, that a remote hit is
downloaded (only with trust_compiled_code) and verified, that a corrupted entry is refused. No compilation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import StubHubRepo

from optimum_qwen36.cli import main as cli_main
from optimum_qwen36.exporters.artifact import UntrustedCodeError
from optimum_qwen36.exporters.compile_cache import (
    ENTRY_NAME,
    CompileCache,
    HubCompileCache,
    make_compile_cache,
)

KEY = "ab" * 32
REPO = "me/qwen36-compile-cache"


@pytest.fixture
def graphs(tmp_path: Path) -> Path:
    source = tmp_path / "graphs"
    source.mkdir()
    (source / "prefill_chunk.pt2").write_bytes(b"prefill code")
    (source / "decode_step.pt2").write_bytes(b"decode code")
    return source


@pytest.fixture
def hub(tmp_path: Path) -> StubHubRepo:
    return StubHubRepo(tmp_path / "hub")


def _published(hub: StubHubRepo, graphs: Path, tmp_path: Path) -> None:
    """An entry compiled elsewhere, uploaded to the repository."""
    HubCompileCache(REPO, tmp_path / "publisher", api=hub).store(KEY, graphs, {"backend": "cpu"})
    hub.calls.clear()


def test_store_uploads_the_entry_under_its_key(hub: StubHubRepo, graphs: Path, tmp_path: Path) -> None:
    cache = HubCompileCache(REPO, tmp_path / "local", api=hub, token="t", private=True)
    entry = cache.store(KEY, graphs, {"backend": "cpu", "dtype": "bfloat16"})
    assert entry == tmp_path / "local" / KEY and CompileCache(tmp_path / "local").lookup(KEY) == entry
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"]
    create, upload = hub.calls[0][1], hub.calls[1][1]
    assert create["repo_id"] == REPO and create["private"] is True and create["exist_ok"] is True
    assert upload["repo_id"] == REPO and upload["path_in_repo"] == KEY and upload["token"] == "t"
    assert upload["files"] == ["decode_step.pt2", ENTRY_NAME, "prefill_chunk.pt2"]
    assert "backend=cpu" in upload["commit_message"]
    info = json.loads((hub.root / KEY / ENTRY_NAME).read_text())
    assert info["key"] == KEY and set(info["files"]) == {"decode_step.pt2", "prefill_chunk.pt2"}


def test_a_failed_upload_is_a_warning(graphs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class ReadOnly(StubHubRepo):
        def upload_folder(self, **kwargs):
            raise PermissionError("403: no write access")

    cache = HubCompileCache(REPO, tmp_path / "local", api=ReadOnly(tmp_path / "hub"))
    with caplog.at_level(logging.WARNING):
        entry = cache.store(KEY, graphs, {})
    assert entry.is_dir() and "no write access" in caplog.text


def test_remote_hit_is_downloaded_verified_and_cached(hub: StubHubRepo, graphs: Path, tmp_path: Path) -> None:
    _published(hub, graphs, tmp_path)
    cache = HubCompileCache(REPO, tmp_path / "local", api=hub, trust_compiled_code=True, revision="main")
    entry = cache.lookup(KEY)
    assert entry == tmp_path / "local" / KEY
    assert (entry / "decode_step.pt2").read_bytes() == b"decode code"
    download = dict(hub.calls)["snapshot_download"]
    assert download["allow_patterns"] == [f"{KEY}/*"] and download["revision"] == "main"
    assert not [p for p in (tmp_path / "local").iterdir() if p.name.startswith(".")]  # staging removed
    hub.calls.clear()
    assert cache.lookup(KEY) == entry and hub.calls == []  # now a local hit: no Hub access


def test_remote_hit_needs_trust_compiled_code(hub: StubHubRepo, graphs: Path, tmp_path: Path) -> None:
    _published(hub, graphs, tmp_path)
    cache = HubCompileCache(REPO, tmp_path / "local", api=hub)
    with pytest.raises(UntrustedCodeError, match="trust_compiled_code=True"):
        cache.lookup(KEY)
    assert "snapshot_download" not in dict(hub.calls)
    assert cache.lookup("cd" * 32) is None  # a remote miss needs no trust: it compiles locally


@pytest.mark.parametrize(
    "corruption", ["flipped byte", "missing file", "unlisted file", "other key", "path outside"]
)
def test_corrupted_remote_entry_is_refused(
    hub: StubHubRepo, graphs: Path, tmp_path: Path, corruption: str, caplog: pytest.LogCaptureFixture
) -> None:
    _published(hub, graphs, tmp_path)
    remote = hub.root / KEY
    info_path = remote / ENTRY_NAME
    info = json.loads(info_path.read_text())
    if corruption == "flipped byte":
        (remote / "decode_step.pt2").write_bytes(b"decode cod\xe5")
    elif corruption == "missing file":
        (remote / "decode_step.pt2").unlink()
    elif corruption == "unlisted file":
        (remote / "extra.so").write_bytes(b"injected")
    elif corruption == "other key":
        info["key"] = "cd" * 32
    else:
        info["files"]["../../outside.pt2"] = info["files"]["decode_step.pt2"]
    info_path.write_text(json.dumps(info))
    cache = HubCompileCache(REPO, tmp_path / "local", api=hub, trust_compiled_code=True)
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(KEY) is None
    assert "Refusing compile cache entry" in caplog.text
    assert list((tmp_path / "local").iterdir()) == []  # nothing of it kept


def test_unreachable_repository_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Offline(StubHubRepo):
        def file_exists(self, *args, **kwargs):
            raise ConnectionError("offline")

    cache = HubCompileCache(REPO, tmp_path / "local", api=Offline(tmp_path / "hub"), trust_compiled_code=True)
    with caplog.at_level(logging.WARNING):
        assert cache.lookup(KEY) is None
    assert "offline" in caplog.text


def test_repository_from_argument_or_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OPTIMUM_QWEN36_CACHE_REPO", raising=False)
    assert type(make_compile_cache(tmp_path)) is CompileCache
    cache = make_compile_cache(tmp_path, "me/a", trust_compiled_code=True, api=object())
    assert isinstance(cache, HubCompileCache) and cache.repo_id == "me/a" and cache.trust_compiled_code
    monkeypatch.setenv("OPTIMUM_QWEN36_CACHE_REPO", "me/b")
    cache = make_compile_cache(tmp_path, api=object())
    assert isinstance(cache, HubCompileCache) and cache.repo_id == "me/b" and not cache.trust_compiled_code
    assert cache.root == tmp_path


def test_cli_cache_lookup_reports_a_hub_hit(
    hub: StubHubRepo,
    graphs: Path,
    tmp_path: Path,
    tiny_checkpoint,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    from optimum_qwen36 import NeuronQwen36ForCausalLM
    from optimum_qwen36.exporters import compile_cache
    from optimum_qwen36.exporters.compile_cache import compile_key
    from optimum_qwen36.network.config import load_config

    checkpoint, _ = tiny_checkpoint()
    flags = ["--backend", "cpu", "--sequence-length", "64", "--dtype", "float32"]
    flags += ["--compile-cache-dir", str(tmp_path / "local"), "--compile-cache-repo", REPO]
    settings = dict(backend="cpu", batch_size=1, sequence_length=64, dtype="float32", kv_block_size=64)
    neuron_config = NeuronQwen36ForCausalLM.get_neuron_config(checkpoint, tp_degree=1, **settings)
    key = compile_key(load_config(str(checkpoint)).to_dict(), neuron_config.to_dict(), "cpu")
    HubCompileCache(REPO, tmp_path / "publisher", api=hub).store(key, graphs, {})
    real = compile_cache.make_compile_cache
    monkeypatch.setattr(compile_cache, "make_compile_cache", lambda *a, **k: real(*a, **k, api=hub))
    assert cli_main(["cache", "lookup", str(checkpoint), *flags]) == 0
    assert f"hit in {REPO}" in capsys.readouterr().out
    assert not (tmp_path / "local").exists()  # lookup downloads nothing
