"""Compiling the `neuron` backend: TorchNeuron's torch.compile is lazy, so each step runs once at the static
shapes it will run at, and its NEFF is built now, into the process's NEFF cache (backends/neuron.py), from
which `save_pretrained()` copies it into the artifact.
"""

from __future__ import annotations

import logging

import torch

from ..backends.neuron import NEFF_CACHE_ENV, NeuronBackend
from ..network.cache import CacheStorage
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig
from .example_args import example_step_args

logger = logging.getLogger(__name__)


def compile_image_steps(backend: NeuronBackend, neuron_config: Qwen36NeuronConfig) -> None:
    """Compile the image graphs of the prefill and decode steps (a prompt's image arguments: rotary
    positions, image features and where they go), which prompts with images run; their NEFFs join those
    `compile_neuron_backend` recorded."""
    config = backend.model.config
    cache = CacheStorage.for_settings(config, neuron_config, backend.device, snapshot_slots=0)
    examples = example_step_args(neuron_config, cache)
    chunk, batch = neuron_config.prefill_chunk_size, neuron_config.batch_size
    prefill_images = {
        "rope_positions": torch.zeros((3, 1, chunk), dtype=torch.long),
        "vision_embeds": torch.zeros((1, chunk, config.hidden_size), dtype=neuron_config.torch_dtype),
        "vision_mask": torch.zeros((1, chunk), dtype=torch.bool),
    }
    backend.run("prefill_chunk", examples["prefill_chunk"], prefill_images)
    backend.run(
        "decode_step",
        examples["decode_step"],
        {"rope_positions": torch.zeros((3, batch, 1), dtype=torch.long)},
    )
    backend.record_compiled()


def compile_neuron_backend(model: Qwen36ForCausalLM, neuron_config: Qwen36NeuronConfig) -> NeuronBackend:
    """The neuron backend of `model` with every step compiled: decode, verify and MTP steps at the full
    batch (the static batch), the MTP step at each of its widths."""
    backend = NeuronBackend(model, neuron_config)
    cache = CacheStorage.for_settings(backend.model.config, neuron_config, backend.device, snapshot_slots=0)
    examples = example_step_args(neuron_config, cache, backend.model.config.hidden_size)
    examples["prefill_chunk_hidden"] = examples["prefill_chunk"]
    for method in backend.steps:
        if method == "mtp_step":
            input_ids, hidden, start_pos, num_valid, *rest = examples[method]
            for width in backend.mtp_widths:
                narrow = (input_ids[:, :width], hidden[:, :width], start_pos, num_valid.clamp(max=width))
                backend.run(method, (*narrow, *rest))
        else:
            backend.run(method, examples[method])
    if not backend.record_compiled() and not backend.neff_cache.written_here():
        logger.warning(
            "Compiling the neuron steps wrote no NEFF into %s (%s). Either the NEFFs were there before "
            "this process (save_pretrained() carries only NEFFs written by this process), or the Neuron "
            "runtime had read %s before this model was created (it reads it once per process: create "
            "the model before other Neuron work), or TORCH_NEURONX_NEFF_DISABLE_CACHE is set. A saved "
            "model will be compiled again when it is loaded.",
            backend.neff_cache.directory,
            NEFF_CACHE_ENV,
            NEFF_CACHE_ENV,
        )
    return backend
