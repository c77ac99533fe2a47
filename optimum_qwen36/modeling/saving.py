"""Saving a model: the checkpoint format it was loaded from (config, safetensors weights, joined from the
ranks' shards under tensor parallelism), its export settings, tokenizer, compiled graphs, a model card and
a manifest of sha256 hashes; and pushing that to the Hub."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from huggingface_hub import HfApi, split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import PretrainedConfig

from ..backends.base import COMPILED_DIR
from ..distributed.group import COLLECTIVE_TIMEOUT, TensorParallelWorkerError
from ..distributed.replicated import Driver, on_every_rank
from ..exporters import artifact
from ..network.int4 import compressed_tensors_state
from ..network.quantization import SCALE_SUFFIX
from ..network.sharding import sharding_plan, unshard_scale, unshard_tensor
from ..ops.fp8 import FP8_DTYPE
from .export import SHARDING_PLAN

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class SaveMixin:
    """`save_pretrained` and `push_to_hub` of the model class."""

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write config, neuron config, generation config, tokenizer, weights (safetensors shards), the
        compiled graphs, a model card and a manifest with the sha256 of every file."""
        os.makedirs(save_directory, exist_ok=True)
        self._checkpoint_config().save_pretrained(save_directory)
        self.neuron_config.save(save_directory)
        self.generation_config.save_pretrained(save_directory)
        self._save_weights(save_directory)
        self._save_tokenizer(save_directory)
        self.backend.save(Path(save_directory))
        if isinstance(self.tensor_parallel, Driver) and self.backend.per_rank_graphs:
            compiled = Path(save_directory) / COMPILED_DIR
            saved = sorted(p.relative_to(compiled).as_posix() for p in compiled.rglob("*") if p.is_file())
            self._add_ranks_compiled_files(saved, directory=Path(save_directory))
        artifact.write_model_card(save_directory, self.neuron_config)
        # Last: it hashes every file written above.
        # The plan says which slice of each saved tensor a rank binds to the graphs of `compiled/` (every
        # rank's on neuron; on cpu, rank 0's are every rank's: same local shapes, weights bound at load).
        plan = {}
        if self.neuron_config.tp_degree > 1:
            plan = {SHARDING_PLAN: sharding_plan(name for name, _ in self.model.named_parameters())}
        artifact.write_manifest(
            save_directory, self.neuron_config.backend, self.neuron_config.tp_degree, extra=plan
        )

    @on_every_rank(local=("directory",))
    def _add_ranks_compiled_files(self, saved: list[str], directory: Path | None = None) -> None:
        """On a backend whose ranks compile graphs of their own: every worker sends its compiled files that
        rank 0 has not `saved` (paths in `compiled/`), and rank 0 adds them to the model it saves at
        `directory`. A worker that cannot send them says so, and every rank raises the same error."""
        group = self.tensor_parallel.group
        if not group.is_driver:
            key = f"compiled-files/{group.rank}"
            try:
                files = self.backend.compiled_files()
                group.post(key, (True, {name: data for name, data in files.items() if name not in saved}))
            except Exception as error:
                group.post(key, (False, f"{type(error).__name__}: {error}"))
                raise RuntimeError(
                    f"rank {group.rank} could not send its compiled graphs: {error}"
                ) from error
            return
        for rank in range(1, group.degree):
            key = f"compiled-files/{rank}"
            if not group.wait_for(key, COLLECTIVE_TIMEOUT, group.worker_status):
                raise TensorParallelWorkerError(
                    f"tensor-parallel worker rank {rank} did not send its compiled graphs within "
                    f"{COLLECTIVE_TIMEOUT}"
                )
            sent, files = group.take(key)
            if not sent:
                raise RuntimeError(f"rank {rank} could not send its compiled graphs: {files}")
            self.backend.add_compiled_files(directory, files)

    def _checkpoint_config(self) -> PretrainedConfig:
        """The config a saved model's checkpoint carries: the language model's."""
        return self.config

    def _checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors a saved model's checkpoint holds, by key, from the language model's `state`."""
        return state

    def _save_weights(self, directory: str | os.PathLike, max_shard_size: str = "5GB") -> None:
        state = self._checkpoint_state(self._full_state_dict())
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: state[n].contiguous() for n in names}, os.path.join(directory, filename))
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)

    @on_every_rank()
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters (with tensor parallelism: every rank's shards joined)."""
        # named_parameters() lists a tied weight once: the checkpoint keeps only the embedding.
        # On the host: safetensors and gloo take cpu tensors (a backend may keep the weights on its device).
        state = {name: p.detach().cpu() for name, p in self.model.named_parameters()}
        if self.tensor_parallel is None:
            return compressed_tensors_state(self.model, state)
        group, gathered = self.tensor_parallel.group, {}
        for name, tensor in state.items():
            if tensor.dtype == FP8_DTYPE:  # gloo does not move float8: its bytes travel as uint8
                shards = [shard.view(FP8_DTYPE) for shard in group.all_gather(tensor.view(torch.uint8))]
            else:
                shards = group.all_gather(tensor)
            if group.is_driver:  # the workers take part in the gathers and keep nothing
                gathered[name] = shards
        full = {
            name: unshard_tensor(self.config, name, shards, group.degree)
            for name, shards in gathered.items()
            if not name.endswith(SCALE_SUFFIX)
        }
        for name, shards in gathered.items():  # the scales, once their weights are whole
            if name.endswith(SCALE_SUFFIX):
                module = name.removesuffix(SCALE_SUFFIX)
                weight_shape = tuple(full[f"{module}.weight"].shape)
                block_size = self.model.get_submodule(module).block_size
                full[name] = unshard_scale(self.config, f"{module}.weight", shards, weight_shape, block_size)
        return full

    def _save_tokenizer(self, directory: str | os.PathLike) -> None:
        """The checkpoint's own tokenizer files, or the Qwen3.5/3.6 tokenizer shipped with this package."""
        for name in TOKENIZER_FILES:
            source = os.path.join(self.tokenizer_dir, name)
            if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(
                os.path.join(directory, name)
            ):
                shutil.copyfile(source, os.path.join(directory, name))

    def push_to_hub(
        self,
        save_directory: str | os.PathLike,
        repository_id: str,
        private: bool | None = None,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        api: HfApi | None = None,
    ) -> str:
        """Upload a directory written by `save_pretrained` to the Hub; returns the commit URL."""
        api = api or HfApi(endpoint=endpoint, token=token)
        api.create_repo(repository_id, private=private, exist_ok=True, token=token)
        if revision is not None:
            api.create_branch(repository_id, branch=revision, exist_ok=True, token=token)
        commit = api.upload_folder(
            folder_path=str(save_directory), repo_id=repository_id, revision=revision, token=token
        )
        return str(commit)
