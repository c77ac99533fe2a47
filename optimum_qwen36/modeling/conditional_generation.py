"""`NeuronQwen36ForConditionalGeneration`: Qwen3.5 / Qwen3.6 as the vision-language model its checkpoints
hold, images in through generate(), the engine and the server."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from ..backends.base import ImageEncoder
from ..exporters.neuron import compile_image_steps
from ..network.config import MULTIMODAL_LM_PREFIX, is_multimodal_layout
from ..network.vision import VISION_PREFIX
from ..network.weights import build_vision_tower
from .causal_lm import NeuronQwen36ForCausalLM


class NeuronQwen36ForConditionalGeneration(NeuronQwen36ForCausalLM):
    """transformers' `Qwen3_5ForConditionalGeneration` (a checkpoint with a `vision_config`): the language
    model of `NeuronQwen36ForCausalLM` plus the vision tower. generate() takes the processor's outputs
    (`input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw`); the engine (`create_engine()`,
    `optimum-qwen36 serve`) takes `EngineRequest(images=...)`. A saved model is a
    Qwen3_5ForConditionalGeneration checkpoint again."""

    # Not in from_pretrained's registry: NeuronModelForCausalLM keeps resolving to the text model.
    model_types: ClassVar[tuple[str, ...]] = ()
    checkpoint_config: PretrainedConfig

    def _load_beyond_text(self, config: PretrainedConfig, checkpoint_dir: str) -> None:
        if not is_multimodal_layout(config):
            raise ValueError(
                f"{checkpoint_dir} holds a text-only {config.model_type!r} checkpoint (no vision_config): "
                "load it with NeuronQwen36ForCausalLM."
            )
        if self.tensor_parallel is not None:
            raise ValueError(
                "images with tensor parallelism are not supported: export with tp_degree=1, or load the "
                "language model alone with NeuronQwen36ForCausalLM."
            )
        vision_config = config.vision_config
        tower = build_vision_tower(
            vision_config, checkpoint_dir, self.neuron_config.torch_dtype, self.backend.device
        )
        placeholders = (config.image_token_id,)
        self.image_encoder = ImageEncoder(tower, placeholders, vision_config.spatial_merge_size)
        self.checkpoint_config = config
        if self.backend.name == "neuron":
            # The tower runs on the host (images of any size; static-shape NEFFs would need a bucket per
            # size); the language model's steps with images are graphs of their own.
            compile_image_steps(self.backend, self.neuron_config)

    def _checkpoint_config(self) -> PretrainedConfig:
        """The whole vision-language config, with the language model's as exported (quantization)."""
        config = self.checkpoint_config
        config.text_config = self.config
        return config

    def _checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Qwen3_5ForConditionalGeneration's keys: the language model under `model.language_model.`, the
        tower under `model.visual.`."""
        keys = {}
        for name, tensor in state.items():
            inside = name.startswith("model.")
            keys[MULTIMODAL_LM_PREFIX + name.removeprefix("model.") if inside else name] = tensor
        assert self.image_encoder is not None
        for name, tensor in self.image_encoder.tower.named_parameters():
            keys[VISION_PREFIX + name] = tensor.detach().cpu()
        return keys
