"""Local cache of compiled graphs, keyed by everything that changes the compiled code.

Weights are not compiled into the graphs (they are bound at load; `aoti.compile_method` refuses a graph that
holds the value of any weight), so the key is the model *architecture* (config), the static shapes and dtype
(neuron config minus the checkpoint id), the software versions / CPU ISA and the source of the code the
graphs are traced from: exporting another checkpoint of the same architecture reuses the compilation and
computes with that checkpoint's weights (tests/test_export_configs.py), while a change to the model code
never reuses stale graphs.

Location: $OPTIMUM_QWEN36_CACHE, else $XDG_CACHE_HOME/optimum-qwen36, else ~/.cache/optimum-qwen36.

A Hub repository can back the local cache (`HubCompileCache`: `compile_cache_repo=` or
$OPTIMUM_QWEN36_CACHE_REPO), with the same keys: an entry is the folder `<key>/` of the repository.
A local miss is looked up there (downloading needs `trust_compiled_code=True`: the graphs are native code)
and verified against its sha256s before it enters the local cache; a fresh compilation is uploaded there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .artifact import NATIVE_CODE_SUFFIXES, UntrustedCodeError, environment, sha256_file

logger = logging.getLogger(__name__)

CACHE_ENV = "OPTIMUM_QWEN36_CACHE"
CACHE_REPO_ENV = "OPTIMUM_QWEN36_CACHE_REPO"
ENTRY_NAME = "entry.json"
# Settings the compiled graphs do not depend on: the source checkpoint (weights are bound at load) and
# prefix caching (it only changes the number of KV blocks, a dynamic dimension of the graphs).
_NEURON_CONFIG_IGNORED = (
    "checkpoint_id",
    "checkpoint_revision",
    "prefix_caching",
    "prefix_cache_bytes",
    "prefix_cache_granularity",
    "prefix_cache_interval",
)
_MODEL_CONFIG_IGNORED = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype")


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "optimum-qwen36"


# The exporters' and backends' modules that decide what the compiled cpu/cuda graphs are (how they are
# traced and cut, with what arguments) or how the runtime reads them (file names, shapes, bound constants).
_EXPORTER_SOURCES = ("aoti.py", "compile_aoti.py", "example_args.py", "matvec.py", "regions.py")
_BACKEND_SOURCES = ("aoti.py", "base.py", "compiled_graph.py", "regions.py")


def graph_sources() -> list[Path]:
    """The code the compiled graphs come from: the network (its layers, quantization, sharding plan), every
    op it calls (PyTorch forms and native sources), the NKI twins, and how this package exports and loads
    them."""
    from .. import backends
    from ..network import model
    from ..nki import kernels
    from ..ops import native

    kernel_dir = Path(kernels.__file__).parent
    backend_dir = Path(backends.__file__).parent
    return [
        *sorted(Path(model.__file__).parent.glob("*.py")),
        *sorted(Path(native.__file__).parent.glob("*.py")),
        *native.FILES,
        kernel_dir.parent / "__init__.py",
        *sorted(kernel_dir.glob("*_torch.py")),
        *(Path(__file__).parent / name for name in _EXPORTER_SOURCES),
        *(backend_dir / name for name in _BACKEND_SOURCES),
    ]


@functools.cache
def graph_source_digest() -> str:
    """sha256 of `graph_sources`: the package version does not change between development commits, so it
    alone would let stale graphs be reused."""
    digest = hashlib.sha256()
    for path in graph_sources():
        digest.update(path.read_bytes())
    return digest.hexdigest()


def compile_key(model_config: Mapping[str, Any], neuron_config: Mapping[str, Any], backend: str) -> str:
    """sha256 of the canonical JSON of (architecture, export settings, versions and ISA, graph source)."""
    payload = {
        "model": {k: v for k, v in model_config.items() if k not in _MODEL_CONFIG_IGNORED},
        "neuron": {k: v for k, v in neuron_config.items() if k not in _NEURON_CONFIG_IGNORED},
        "environment": environment(backend),
        "graph_source": graph_source_digest(),
    }
    canonical = json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class CompileCache:
    """Entries are directories `<root>/<key>/` with the compiled files and `entry.json` (their sha256)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def lookup(self, key: str) -> Path | None:
        """The entry's directory, or None. An entry whose files do not match their hashes is removed."""
        entry = self.root / key
        info_path = entry / ENTRY_NAME
        if not info_path.is_file():
            return None
        with open(info_path) as f:
            info = json.load(f)
        for name, digest in info["files"].items():
            path = entry / name
            if not path.is_file() or sha256_file(path) != digest:
                logger.warning("Compile cache entry %s is corrupt (%s); removing it.", key, name)
                shutil.rmtree(entry, ignore_errors=True)
                return None
        logger.info("Compile cache hit: %s", entry)
        return entry

    def store(self, key: str, source_dir: str | os.PathLike, description: Mapping[str, Any]) -> Path:
        """Copy every file of `source_dir` into the entry `key` (atomically: a reader never sees half)."""
        self.root.mkdir(parents=True, exist_ok=True)
        source = Path(source_dir)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        try:
            shutil.copytree(source, staging, dirs_exist_ok=True)
            files = {
                p.relative_to(staging).as_posix(): sha256_file(p) for p in staging.rglob("*") if p.is_file()
            }
            info = {"key": key, "created": time.time(), "files": files, "description": dict(description)}
            with open(staging / ENTRY_NAME, "w") as f:
                json.dump(info, f, indent=2, sort_keys=True, default=str)
            entry = self.root / key
            if CompileCache.lookup(self, key) is not None:  # local only, never the Hub
                # Another process (a tensor-parallel rank, say) stored it meanwhile and may be reading it.
                shutil.rmtree(staging)
                return entry
            shutil.rmtree(entry, ignore_errors=True)
            staging.rename(entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return entry

    def entries(self) -> list[dict[str, Any]]:
        """Every entry's entry.json plus its size in bytes."""
        found = []
        if not self.root.is_dir():
            return found
        for info_path in sorted(self.root.glob(f"*/{ENTRY_NAME}")):
            with open(info_path) as f:
                info = json.load(f)
            info["bytes"] = sum(p.stat().st_size for p in info_path.parent.rglob("*") if p.is_file())
            found.append(info)
        return found

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        count = 0
        if self.root.is_dir():
            for child in self.root.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
                    count += 1
        return count


class CompileCacheIntegrityError(ValueError):
    """A downloaded compile-cache entry does not match its key or its recorded sha256s."""


def verify_entry(entry: Path, key: str) -> dict[str, Any]:
    """Check an entry directory against its entry.json: the key, every file's sha256, no path outside the
    entry and no file that is not listed. Returns entry.json's content."""
    info_path = entry / ENTRY_NAME
    if not info_path.is_file():
        raise CompileCacheIntegrityError(f"{entry} has no {ENTRY_NAME}.")
    with open(info_path) as f:
        info = json.load(f)
    if info.get("key") != key:
        raise CompileCacheIntegrityError(f"{entry} holds the entry {info.get('key')!r}, not {key!r}.")
    files: dict[str, str] = info.get("files") or {}
    if not any(name.endswith(NATIVE_CODE_SUFFIXES) for name in files):
        raise CompileCacheIntegrityError(f"{entry} lists no compiled graphs.")
    root = entry.resolve()
    for name, digest in files.items():
        path = (entry / name).resolve()
        if not path.is_relative_to(root) or path == root / ENTRY_NAME:
            raise CompileCacheIntegrityError(f"{entry} lists a file outside the entry: {name!r}.")
        if not path.is_file():
            raise CompileCacheIntegrityError(f"{name} is listed in {entry / ENTRY_NAME} but missing.")
        if sha256_file(path) != digest:
            raise CompileCacheIntegrityError(f"{name} does not match the sha256 in {entry / ENTRY_NAME}.")
    present = {p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file()}
    unlisted = sorted(present - set(files) - {ENTRY_NAME})
    if unlisted:
        raise CompileCacheIntegrityError(f"{entry} holds files not listed in {ENTRY_NAME}: {unlisted}.")
    return info


class HubCompileCache(CompileCache):
    """The local cache, backed by a Hub repository holding entries as `<key>/` folders.

    - lookup: the local cache first; on a miss, the repository's `<key>/` is downloaded (only with
      `trust_compiled_code=True`: loading the graphs runs native code; without it, an existing remote
      entry raises `UntrustedCodeError`), verified (key and sha256 of every file, no unlisted file) and
      moved into the local cache. A corrupt remote entry is refused (a warning, then a miss).
    - store: into the local cache, then uploaded to the repository (a failed upload, e.g. without write
      access, is a warning: the export itself succeeded).

    `api` is a `huggingface_hub.HfApi` (or anything with its `file_exists`, `snapshot_download`,
    `create_repo` and `upload_folder` methods); by default one for `endpoint` / `token`.
    """

    def __init__(
        self,
        repo_id: str,
        root: str | os.PathLike | None = None,
        *,
        trust_compiled_code: bool = False,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        private: bool | None = None,
        api: Any = None,
    ) -> None:
        super().__init__(root)
        self.repo_id = repo_id
        self.trust_compiled_code = trust_compiled_code
        self.revision = revision
        self.token = token
        self.private = private
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(endpoint=endpoint, token=token)
        self.api = api

    def remote_has(self, key: str) -> bool:
        """Whether the repository holds the entry `key` (downloads nothing)."""
        return bool(
            self.api.file_exists(
                self.repo_id,
                f"{key}/{ENTRY_NAME}",
                repo_type="model",
                revision=self.revision,
                token=self.token,
            )
        )

    def lookup(self, key: str) -> Path | None:
        entry = super().lookup(key)
        if entry is not None:
            return entry
        try:
            found = self.remote_has(key)
        except Exception as error:  # offline, no such repository, no access: compile locally
            logger.warning(
                "Compile cache repository %s not reachable (%s); not using it.", self.repo_id, error
            )
            return None
        if not found:
            logger.info("Compile cache miss in %s: %s", self.repo_id, key)
            return None
        if not self.trust_compiled_code:
            raise UntrustedCodeError(
                f"The compile cache repository {self.repo_id} holds compiled graphs for this export "
                f"({key[:16]}): loading them runs native code from the Hub. If you trust this repository, "
                "pass trust_compiled_code=True (CLI: --trust-compiled-code; the files are still checked "
                f"against their sha256); otherwise drop compile_cache_repo / ${CACHE_REPO_ENV} to compile "
                "locally."
            )
        return self._download(key)

    def _download(self, key: str) -> Path | None:
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.hub.", dir=self.root))
        try:
            start = time.perf_counter()
            self.api.snapshot_download(
                self.repo_id,
                repo_type="model",
                revision=self.revision,
                token=self.token,
                allow_patterns=[f"{key}/*"],
                local_dir=str(staging),
            )
            downloaded = staging / key
            try:
                verify_entry(downloaded, key)
            except CompileCacheIntegrityError as error:
                logger.warning(
                    "Refusing compile cache entry %s from %s: %s Compiling locally.", key, self.repo_id, error
                )
                return None
            entry = self.root / key
            if entry.exists():
                shutil.rmtree(entry)
            downloaded.rename(entry)
            logger.info(
                "Compile cache hit in %s: %s (downloaded in %.1f s)",
                self.repo_id,
                key,
                time.perf_counter() - start,
            )
            return entry
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def store(self, key: str, source_dir: str | os.PathLike, description: Mapping[str, Any]) -> Path:
        entry = super().store(key, source_dir, description)
        try:
            self.api.create_repo(
                self.repo_id, repo_type="model", private=self.private, exist_ok=True, token=self.token
            )
            summary = ", ".join(f"{k}={v}" for k, v in sorted(description.items()))
            self.api.upload_folder(
                repo_id=self.repo_id,
                repo_type="model",
                folder_path=str(entry),
                path_in_repo=key,
                revision=self.revision,
                token=self.token,
                commit_message=f"Add compiled graphs {key[:16]} ({summary})",
            )
            logger.info("Uploaded compile cache entry %s to %s", key, self.repo_id)
        except Exception as error:
            logger.warning("Could not upload compile cache entry %s to %s: %s", key, self.repo_id, error)
        return entry


def make_compile_cache(
    cache_dir: str | os.PathLike | None = None,
    cache_repo: str | None = None,
    *,
    trust_compiled_code: bool = False,
    token: str | None = None,
    api: Any = None,
) -> CompileCache:
    """The local compile cache, backed by the Hub repository `cache_repo` (else $OPTIMUM_QWEN36_CACHE_REPO)
    when one is set."""
    repo = cache_repo or os.environ.get(CACHE_REPO_ENV) or None
    if repo is None:
        return CompileCache(cache_dir)
    return HubCompileCache(repo, cache_dir, trust_compiled_code=trust_compiled_code, token=token, api=api)
