"""Saved-artifact integrity and compatibility: a manifest with the sha256 of every file, the versions and
CPU ISA the compiled code was built for, checks that refuse what does not match, and the model card."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..ops.native import cpu_flags, load_native_ops

MANIFEST_NAME = "export_manifest.json"
# 2: decode steps take each row's GDN state slot (format 1's graphs do not).
# 3: cpu/cuda steps are compiled by regions, <step>.<region>.pt2 (format 2 has one graph per step).
# 4: prefill_chunk graphs take 2..chunk tokens, a chunk's valid ones (format 3's take a whole padded chunk).
# 5: cpu/cuda exports record what their graphs take (compiled/step_shapes.json), decided on the exporting CPU;
#    prefill has a head graph of its own and, above a batch of one, decode_step decodes every row (format 4's
#    bf16 exports ran one row through decode_step graphs that Inductor had compiled for 2..batch rows only).
# 6: where prefill takes any token count, it also packs sequences (per-sequence start_pos, num_valid, slots
#    and block tables; 2..batch + 1 sequences), and decode_row has its own head.
MANIFEST_FORMAT = 7
# SIMD extensions compiled CPU code may use. Inductor builds with -march=native, so a graph compiled on one
# CPU may execute any of the builder's extensions: the loading CPU must have them all.
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
# Files that hold native code: loading them executes it.
NATIVE_CODE_SUFFIXES = (".pt2", ".so", ".neff")


class ArtifactError(ValueError):
    """Base class: a saved model cannot be used as it is."""


class ArtifactIntegrityError(ArtifactError):
    """A file is missing, was added, or does not match the sha256 recorded at export."""


class ArtifactVersionError(ArtifactError):
    """The artifact was compiled by other versions of torch / the compiler / optimum-qwen36."""


class ArtifactISAError(ArtifactError):
    """The compiled CPU code uses instructions this CPU lacks."""


class ArtifactTopologyError(ArtifactError):
    """The artifact was compiled for another backend or tensor-parallel degree than can run here."""


class UntrustedCodeError(ArtifactError):
    """Compiled native code from the Hub, loaded without the explicit opt-in."""


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def cpu_isa() -> list[str]:
    """The SIMD extensions of this CPU that compiled code may rely on."""
    flags = cpu_flags()
    return [flag for flag in ISA_FLAGS if flag in flags]


def compiler_version(backend: str) -> str:
    """What compiled the graphs: Inductor (versioned with torch) or the Neuron compiler."""
    if backend == "neuron":
        try:
            import neuronxcc  # the Neuron compiler, only present with the Neuron SDK

            return f"neuronx-cc {neuronxcc.__version__}"
        except ImportError:
            return "neuronx-cc (not installed)"
    return f"inductor {torch.__version__}"


def environment(backend: str) -> dict[str, Any]:
    """The versions (and, for cpu, the ISA) a compiled artifact is valid for."""
    env: dict[str, Any] = {
        "optimum_qwen36": __version__,
        "torch": torch.__version__,
        "compiler": compiler_version(backend),
        "machine": platform.machine(),
    }
    if backend == "cpu":
        env["cpu_isa"] = cpu_isa()
        # Attention, FP8 and bf16 linear layers are traced as calls of the native kernels where they build.
        env["native_ops"] = load_native_ops()
    if backend == "cuda" and torch.cuda.is_available():
        env["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    if backend == "neuron":
        # torch pins the torch-neuronx family (2.13.x / 2.14.x); the release within it matters too.
        env["torch_neuronx"] = _distribution_version("torch-neuronx")
    return env


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _files(directory: Path) -> list[str]:
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and ".cache" not in p.relative_to(directory).parts
    )


def write_manifest(
    directory: str | os.PathLike, backend: str, tp_degree: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Hash every file under `directory` and record the environment the artifact is valid for."""
    root = Path(directory)
    manifest = {
        "format": MANIFEST_FORMAT,
        "backend": backend,
        "tp_degree": tp_degree,
        "environment": environment(backend),
        "files": {name: sha256_file(root / name) for name in _files(root)},
        **(extra or {}),
    }
    with open(root / MANIFEST_NAME, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactIntegrityError(
            f"{directory} has no {MANIFEST_NAME}: it was not written by save_pretrained of a compiled model "
            "(or the file was removed). Re-export with from_pretrained(..., export=True)."
        )
    with open(path) as f:
        return json.load(f)


def verify_files(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Refuse missing, modified, or unlisted native-code files."""
    root = Path(directory)
    recorded: dict[str, str] = manifest["files"]
    for name, expected in recorded.items():
        path = root / name
        if not path.is_file():
            raise ArtifactIntegrityError(f"{name} is listed in {MANIFEST_NAME} but missing from {directory}.")
        if sha256_file(path) != expected:
            raise ArtifactIntegrityError(
                f"{path} does not match the sha256 recorded in {MANIFEST_NAME}: the file was modified or "
                "corrupted after export. Download it again or re-export the model."
            )
    unlisted = [n for n in _files(root) if n not in recorded and n.endswith(NATIVE_CODE_SUFFIXES)]
    if unlisted:
        raise ArtifactIntegrityError(
            f"{directory} holds compiled code that is not in {MANIFEST_NAME}: {unlisted}. Remove it or "
            "re-export the model."
        )


def check_environment(manifest: dict[str, Any], backend: str, tp_degree: int) -> None:
    """Refuse an artifact built for another backend, tp degree, software version or CPU ISA."""
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ArtifactVersionError(
            f"The artifact was saved by another version of optimum-qwen36 (manifest format "
            f"{manifest.get('format')!r}; this version reads format {MANIFEST_FORMAT}, whose compiled steps "
            "take other arguments): re-export the model with this version."
        )
    if manifest["backend"] != backend:
        raise ArtifactTopologyError(
            f"The artifact was compiled for the {manifest['backend']!r} backend, not {backend!r}."
        )
    if manifest["tp_degree"] != tp_degree:
        raise ArtifactTopologyError(
            f"The artifact was compiled for tp_degree={manifest['tp_degree']} but this machine runs "
            f"tp_degree={tp_degree}: re-export with tp_degree={tp_degree}."
        )
    built, here = manifest["environment"], environment(backend)
    for key in ("optimum_qwen36", "torch", "torch_neuronx", "compiler", "machine", "cuda_capability"):
        if built.get(key) != here.get(key):
            raise ArtifactVersionError(
                f"The artifact was compiled with {key} {built.get(key)!r}, this environment has "
                f"{here.get(key)!r}. Compiled graphs only run with the versions that built them: re-export "
                "the model here (from_pretrained(checkpoint, export=True, ...)) or install those versions."
            )
    missing = sorted(set(built.get("cpu_isa", [])) - set(here.get("cpu_isa", [])))
    if missing:
        raise ArtifactISAError(
            f"The compiled CPU code was built for instructions this CPU lacks: {missing}. Re-export the "
            "model on this machine (or on one with the same or fewer CPU features)."
        )
    if built.get("native_ops") and not here.get("native_ops"):
        raise ArtifactVersionError(
            "The artifact was compiled where this package's native CPU kernels were built, so its graphs "
            "call them (optimum_qwen36::paged_attention, bf16_linear, fp8_linear), and they could not be "
            "built here (the warning above says why). Install a C++ compiler, or re-export the model here "
            "(from_pretrained(checkpoint, export=True, ...)), which then traces PyTorch in their place."
        )


def verify_artifact(directory: str | os.PathLike, backend: str, tp_degree: int) -> dict[str, Any]:
    """Integrity then compatibility; returns the manifest."""
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    check_environment(manifest, backend, tp_degree)
    return manifest


def resolve_artifact(
    model_id: str | os.PathLike, revision: str | None = None, token: str | None = None
) -> tuple[str, bool]:
    """(local directory, whether it was downloaded from the Hub) of a saved model: a directory as is, or
    a Hub repository's snapshot (every file: the compiled graphs too)."""
    if os.path.isdir(model_id):
        return str(model_id), False
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(str(model_id), revision=revision, token=token), True
    except Exception as error:
        raise OSError(
            f"{model_id!r} is neither a local directory nor a Hub repository that could be downloaded "
            f"({type(error).__name__}: {error}). Pass the directory written by save_pretrained, or a Hub id "
            "while online (set HF_TOKEN for private repositories)."
        ) from error


def write_model_card(
    directory: str | os.PathLike, neuron_config: Any, repository_id: str | None = None
) -> None:
    """README.md with Hub metadata (library_name, base_model, tags), the export settings and how to load."""
    settings = neuron_config.to_dict()
    base_model = settings.get("checkpoint_id")
    # Only a Hub id (namespace/name, not a local path) is a valid base_model.
    is_hub_id = bool(base_model) and base_model.count("/") == 1 and not os.path.exists(base_model)
    header = ["---", "library_name: optimum-qwen36"]
    if is_hub_id:
        header.append(f"base_model: {base_model}")
    header += [
        "tags:",
        "- optimum-qwen36",
        "- qwen3_5",
        f"- {settings['backend']}",
        "- text-generation",
        "pipeline_tag: text-generation",
        "---",
    ]
    name = repository_id or "path/to/this/directory"
    trust = ", trust_compiled_code=True" if settings["backend"] in ("cpu", "cuda", "neuron") else ""
    table = "\n".join(f"| `{key}` | `{value}` |" for key, value in sorted(settings.items()))
    body = f"""
# {Path(name).name}

{f"[{base_model}](https://huggingface.co/{base_model})" if is_hub_id else "A Qwen3.5/3.6 hybrid model"}
exported with [optimum-qwen36](https://github.com/) for the `{settings["backend"]}` backend.

## Export settings

| setting | value |
| --- | --- |
{table}

The compiled graphs only run with the torch / compiler / optimum-qwen36 versions (and, for `cpu`, on a
CPU with the instruction sets) recorded in `{MANIFEST_NAME}`, which also holds the sha256 of every file.

## Load

```python
from optimum_qwen36 import NeuronQwen36ForCausalLM

model = NeuronQwen36ForCausalLM.from_pretrained("{name}"{trust})
```

`trust_compiled_code=True` is required for compiled graphs downloaded from the Hub: loading them runs
native code. Only pass it for repositories you trust.
"""
    with open(Path(directory) / "README.md", "w") as f:
        f.write("\n".join(header) + "\n" + body)
