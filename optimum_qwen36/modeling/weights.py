"""Load a Qwen3.5/3.6 checkpoint (safetensors only) into the static-shape model."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from .qwen36 import Qwen36ForCausalLM

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Keys of Qwen3_5ForConditionalGeneration checkpoints that the language model does not use.
IGNORED_PREFIXES = ("model.visual.", "mtp.")
MULTIMODAL_LM_PREFIX = "model.language_model."
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config."""


def resolve_checkpoint(
    model_id: str | os.PathLike, revision: str | None = None, token: str | None = None
) -> str:
    """A local directory, or a Hub id downloaded (config, safetensors and tokenizer files only)."""
    if os.path.isdir(model_id):
        return str(model_id)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            str(model_id), revision=revision, token=token, allow_patterns=CHECKPOINT_PATTERNS
        )
    except Exception as error:
        raise OSError(
            f"{model_id!r} is neither a local directory nor a Hub repository that could be downloaded "
            f"({type(error).__name__}: {error}). Pass a directory holding config.json and *.safetensors, "
            "or a Hub id while online (set HF_TOKEN for private repositories)."
        ) from error


def safetensors_files(checkpoint_dir: str) -> list[str]:
    index_path = os.path.join(checkpoint_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(checkpoint_dir) if n.endswith(".safetensors"))
    if not names:
        found = sorted(os.listdir(checkpoint_dir))
        raise CheckpointError(
            f"No *.safetensors weights in {checkpoint_dir} (found {found}). optimum-qwen36 loads safetensors "
            "only; convert pickled .bin weights with transformers' save_pretrained(safe_serialization=True)."
        )
    missing = [n for n in names if not os.path.isfile(os.path.join(checkpoint_dir, n))]
    if missing:
        raise CheckpointError(f"{checkpoint_dir} lists weight files that are missing: {missing}.")
    return [os.path.join(checkpoint_dir, n) for n in names]


def checkpoint_tensors(checkpoint_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint; tensors are memory-mapped, read on access."""
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                yield name, f.get_tensor(name)


def count_checkpoint_tensors(checkpoint_dir: str) -> int:
    """How many tensors `checkpoint_tensors` yields (reads the safetensors headers only)."""
    total = 0
    for path in safetensors_files(checkpoint_dir):
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    return total


def model_key(checkpoint_key: str, multimodal: bool) -> str | None:
    """The static model's parameter name for a checkpoint key, or None for keys the LM does not use."""
    if checkpoint_key.startswith(IGNORED_PREFIXES):
        return None
    if multimodal:
        if checkpoint_key.startswith(MULTIMODAL_LM_PREFIX):
            return "model." + checkpoint_key.removeprefix(MULTIMODAL_LM_PREFIX)
        if checkpoint_key == "lm_head.weight":
            return checkpoint_key
        return None if checkpoint_key.startswith("model.") else checkpoint_key
    return checkpoint_key


def build_model(
    config: PretrainedConfig,
    checkpoint_dir: str,
    multimodal: bool,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Qwen36ForCausalLM:
    """Build the model on the meta device, then assign every parameter from the checkpoint (cast to dtype).

    Shows a progress bar per tensor on a terminal (tqdm; off when stderr is not a TTY) and logs the time."""
    start = time.perf_counter()
    with torch.device("meta"):
        model = Qwen36ForCausalLM(config)
    expected = {name: p for name, p in model.named_parameters()}  # tied weights appear once
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    progress = tqdm(
        checkpoint_tensors(checkpoint_dir),
        total=count_checkpoint_tensors(checkpoint_dir),
        desc=f"Loading weights as {str(dtype).removeprefix('torch.')}",
        unit="tensor",
        disable=None,
    )
    for key, tensor in progress:
        name = model_key(key, multimodal)
        if name is None:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the output projection
        if name not in expected:
            unexpected.append(key)
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"Tensor {key!r} has shape {tuple(tensor.shape)} but the config implies "
                f"{tuple(expected[name].shape)}: the checkpoint and its config.json do not match."
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {checkpoint_dir} does not match its config: missing {_head(missing)}, "
            f"unexpected {_head(unexpected)}."
        )
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = model.inv_freq_for(config).to(device)
    logger.info(
        "Loaded %d tensors (%.1f MB as %s) from %s in %.1f s",
        len(loaded),
        sum(t.numel() * t.element_size() for t in loaded.values()) / 1e6,
        dtype,
        checkpoint_dir,
        time.perf_counter() - start,
    )
    return model.eval().requires_grad_(False)


def _head(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
