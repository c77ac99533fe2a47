"""Shared test utilities: left-padded random prompts, exporting a tiny checkpoint, a free local port, a
logits processor that fails in one process, a hook on the MTP layer's drafts, images of a tiny
vision-language checkpoint."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import QWEN_VISION_TOKENS, TINY_VISION_TOKENS, save_tiny_checkpoint
from running_server import API_KEY, RunningServer
from transformers.generation.logits_process import LogitsProcessor

from optimum_qwen36 import NeuronQwen36ForCausalLM, NeuronQwen36ForConditionalGeneration
from optimum_qwen36.engine.request import Request
from optimum_qwen36.engine.speculative import MTPDrafter
from optimum_qwen36.network.cache import CacheStorage
from optimum_qwen36.ops.native import BF16_FLAGS, cpu_flags
from optimum_qwen36.server import ServerSettings, build_app, served_model
from optimum_qwen36.server.images import ImageLimits

# A query's bf16 attention is bitwise the same in a prefill chunk and alone, and a bf16 linear layer's row
# the same in a prefill call and in a decode step, with the native kernels built for AVX-512 BF16 (and so a
# request's bf16 tokens in any company). Elsewhere both are ATen's (prefill's linear layers: float32 products
# of the widened values), whose rounding depends on how many rows they take at once, as in float32.
needs_bf16_kernels = pytest.mark.skipif(
    not BF16_FLAGS.keys() <= cpu_flags(),
    reason="the native bf16 kernels need AVX-512 BF16, which this CPU lacks",
)


def left_padded_prompts(
    lengths: list[int], vocab_size: int = 512, seed: int = 0, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded to the longest: (input_ids, attention_mask)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def rewrite_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    """Apply `edit` to the tensors of a one-file checkpoint (model.safetensors) and save them back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(directory / "model.safetensors", framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def edit_config(directory: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Apply `edit` to a checkpoint's config.json."""
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def export_eager(checkpoint: Path, **settings: Any) -> NeuronQwen36ForCausalLM:
    defaults: dict[str, Any] = dict(
        backend="eager", batch_size=3, sequence_length=256, dtype="float32", prefill_chunk_size=16
    )
    return NeuronQwen36ForCausalLM.from_pretrained(checkpoint, export=True, **{**defaults, **settings})


def engine_storage(model: NeuronQwen36ForCausalLM) -> CacheStorage:
    """A cache storage of the shapes the model's engines run in (the steps' cache arguments)."""
    return CacheStorage.for_settings(
        model.model.config,
        model.neuron_config,
        model.backend.device,
        snapshot_slots=model.backend.prefill_snapshots,
    )


class CountingBackend:
    """Wraps a backend and counts the tokens each step kind was given (to prove what was recomputed)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.name = backend.name
        self.device = backend.device
        self.decodes_any_batch = backend.decodes_any_batch
        self.min_step_rows = backend.min_step_rows
        self.packs_prefill = backend.packs_prefill
        self.decodes_in_prefill = backend.decodes_in_prefill
        self.prefill_snapshots = backend.prefill_snapshots
        self.prefill_tokens = 0
        self.prefill_calls = 0
        self.decode_steps = 0

    def prefill_chunk(self, *args: torch.Tensor, **snapshots: torch.Tensor | None) -> torch.Tensor:
        self.prefill_tokens += int(args[2].sum())
        self.prefill_calls += 1
        return self.backend.prefill_chunk(*args, **snapshots)

    def decode_step(self, *args: torch.Tensor) -> torch.Tensor:
        self.decode_steps += 1
        return self.backend.decode_step(*args)

    def save(self, directory: Path) -> None:
        self.backend.save(directory)


class StubHubRepo:
    """An offline stand-in for `huggingface_hub.HfApi` holding one model repository in a directory: the
    methods the Hub compile cache calls, recording each call."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def file_exists(self, repo_id: str, filename: str, **kwargs: Any) -> bool:
        self.calls.append(("file_exists", {"repo_id": repo_id, "filename": filename, **kwargs}))
        return (self.root / filename).is_file()

    def snapshot_download(
        self, repo_id: str, *, allow_patterns: list[str], local_dir: str, **kwargs: Any
    ) -> str:
        import fnmatch
        import shutil

        self.calls.append(
            ("snapshot_download", {"repo_id": repo_id, "allow_patterns": allow_patterns, **kwargs})
        )
        for name in self.files():
            if any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                target = Path(local_dir) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.root / name, target)
        return local_dir

    def create_repo(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id: str, folder_path: str, path_in_repo: str, **kwargs: Any) -> str:
        import shutil

        source = Path(folder_path)
        sent = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file())
        self.calls.append(
            ("upload_folder", {"repo_id": repo_id, "path_in_repo": path_in_repo, "files": sent, **kwargs})
        )
        shutil.copytree(source, self.root / path_in_repo, dirs_exist_ok=True)
        return f"https://huggingface.co/{repo_id}/commit/0"


def assert_greedy_matches_reference(
    ours: Any, reference: Any, rel_tol: float = 1e-4, what: str = "reference"
) -> None:
    """`ours` and `reference` are generate() outputs with `logits`. At every step, every row's logits are
    within rel_tol of that step's largest |logit| (over the batch), and the greedy tokens are equal, except
    after a reference near-tie (its top two logits within twice that tolerance: each side may be off by the
    tolerance), where a row may legitimately diverge: that row is compared up to and including the tie."""
    prompt_width = ours.sequences.shape[1] - len(ours.logits)
    assert ours.sequences.shape == reference.sequences.shape
    torch.testing.assert_close(ours.sequences[:, :prompt_width], reference.sequences[:, :prompt_width])
    for row in range(ours.sequences.shape[0]):
        for step, (mine, theirs) in enumerate(zip(ours.logits, reference.logits, strict=True)):
            tolerance = rel_tol * float(theirs.abs().max())
            diff = float((mine[row] - theirs[row]).abs().max())
            assert diff <= tolerance, f"row {row}, step {step}: max |logit diff| {diff:.3g} > {tolerance:.3g}"
            column = prompt_width + step
            if ours.sequences[row, column] != reference.sequences[row, column]:
                top2 = theirs[row].topk(2).values
                gap = float(top2[0] - top2[1])
                assert gap <= 2 * tolerance, (
                    f"row {row}, step {step}: greedy token {int(ours.sequences[row, column])} != "
                    f"{what}'s {int(reference.sequences[row, column])} (not a near-tie: gap {gap:.3g})"
                )
                break


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server or rendezvous a test starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class FailsInOneProcess(LogitsProcessor):
    """Raises at its `at`-th call in the process that made it (`here`), or else in the processes it was sent
    to (a tensor-parallel model's workers; they import it from this module)."""

    def __init__(self, here: bool, at: int = 3) -> None:
        self.pid, self.here, self.at, self.calls = os.getpid(), here, at, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and (os.getpid() == self.pid) == self.here:
            raise RuntimeError(f"failing on purpose in process {os.getpid()}")
        return scores


def after_drafting(monkeypatch: pytest.MonkeyPatch, hook: Callable[[Request], None]) -> None:
    """Call hook(request) for each request the MTP layer has just drafted for (its `draft_ids` set), in this
    process (with tensor parallelism: rank 0, which drafts for every rank)."""
    real_catch_up, real_extend = MTPDrafter.catch_up, MTPDrafter.extend

    def catch_up(self: MTPDrafter, rows: Any) -> None:
        real_catch_up(self, rows)
        for row in rows:
            hook(row.request)

    def extend(self: MTPDrafter, requests: Any, num_drafts: dict[str, int]) -> None:
        real_extend(self, requests, num_drafts)
        for request in requests:
            hook(request)

    monkeypatch.setattr(MTPDrafter, "catch_up", catch_up)
    monkeypatch.setattr(MTPDrafter, "extend", extend)


def recording_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], int, tuple[int, ...]]]:
    """Every draft the MTP layer proposes from now on: (prompt, tokens generated so far, drafts), in order."""
    drafts: list[tuple[tuple[int, ...], int, tuple[int, ...]]] = []

    def record(request: Request) -> None:
        drafts.append((tuple(request.prompt_ids), len(request.output_ids), tuple(request.draft_ids)))

    after_drafting(monkeypatch, record)
    return drafts


def image_patches(vision_config: Any, grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    """Random pixel patches of an image of `grid` (t, h, w), as the processor emits them."""
    width = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    return torch.randn(grid[0] * grid[1] * grid[2], width, generator=torch.Generator().manual_seed(seed))


def image_tokens(grid: tuple[int, int, int]) -> list[int]:
    """An image's span in a rendered prompt of the tiny vision-language checkpoints: its placeholder
    expanded to one token per 2x2 merged patch, between the vision delimiters."""
    start, end = TINY_VISION_TOKENS["vision_start_token_id"], TINY_VISION_TOKENS["vision_end_token_id"]
    return [start] + [TINY_VISION_TOKENS["image_token_id"]] * (grid[0] * grid[1] * grid[2] // 4) + [end]


def serve_tiny_vision_model(
    directory: Path, served_model_name: str
) -> tuple[RunningServer, NeuronQwen36ForConditionalGeneration]:
    """A random vision-language checkpoint with Qwen's vocabulary and vision tokens, written to `directory`
    and served (eager, float32, two images a prompt at most) with the test API key."""
    save_tiny_checkpoint(
        directory, layout="conditional", seed=4, vision_tokens=QWEN_VISION_TOKENS, vocab_size=248_320
    )
    settings = dict(
        backend="eager", dtype="float32", batch_size=2, sequence_length=256, prefill_chunk_size=32
    )
    model = NeuronQwen36ForConditionalGeneration.from_pretrained(directory, export=True, **settings)
    limits = ImageLimits(max_images_per_prompt=2)
    app = build_app(
        lambda: served_model(model, image_limits=limits), ServerSettings(served_model_name, api_key=API_KEY)
    )
    running = RunningServer(app)
    running.wait_healthy()
    return running, model
