"""Read a Qwen3.5/3.6 checkpoint's configuration, whichever of the two layouts it uses."""

from __future__ import annotations

import os
import re

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# Where Qwen3_5ForConditionalGeneration checkpoints keep the language model (text-only ones: `model.`).
MULTIMODAL_LM_PREFIX = "model.language_model."


def load_config(checkpoint_dir: str | os.PathLike) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(checkpoint_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{checkpoint_dir} holds a {config.model_type!r} model; optimum-qwen36 runs Qwen3.5/Qwen3.6 "
            f"checkpoints (model_type one of {SUPPORTED_MODEL_TYPES})."
        )
    return config


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model config: nested `text_config` for Qwen3_5ForConditionalGeneration checkpoints."""
    text_config = config.text_config if config.model_type == "qwen3_5" else config
    validate_text_config(text_config)
    return text_config


def is_multimodal_layout(config: PretrainedConfig) -> bool:
    """True for Qwen3_5ForConditionalGeneration checkpoints (LM keys under `model.language_model.`)."""
    return config.model_type == "qwen3_5"


def text_model_name(name: str) -> str:
    """A multimodal checkpoint's `model.language_model.X` as the text model's `model.X`; others unchanged."""
    if name.startswith(MULTIMODAL_LM_PREFIX):
        return "model." + name.removeprefix(MULTIMODAL_LM_PREFIX)
    return name


def module_names(module: str) -> tuple[str, str]:
    """A model name (`model.layers.0.mlp`), and the same module's name in the multimodal layout."""
    return module, MULTIMODAL_LM_PREFIX + module.removeprefix("model.")


def pattern_matches(pattern: str, module: str) -> bool:
    """A regular expression (GPTQ `dynamic`, compressed-tensors `re:`) against either name of `module`."""
    return any(re.match(pattern, name) for name in module_names(module))


def excludes(entry: str, module: str) -> bool:
    """Whether a quantization_config exclusion entry (`modules_to_not_convert`, `ignore`, ...) names
    `module` (a model name): `re:` a regular expression; else a name with or without the multimodal
    layout's `model.language_model.` prefix (transformers #48349: prefixed entries never matched a
    text-only load) of the module, of a parent, or a suffix such as `lm_head` or `linear_attn.in_proj_a`."""
    if entry.startswith("re:"):
        return pattern_matches(entry.removeprefix("re:"), module)
    entry = text_model_name(entry)
    return module == entry or module.startswith(entry + ".") or module.endswith("." + entry)


def validate_text_config(config: PretrainedConfig) -> None:
    unknown = sorted(set(config.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"Unsupported layer types {unknown} in config.layer_types.")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(
            f"config.layer_types has {len(config.layer_types)} entries for {config.num_hidden_layers} layers."
        )
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({config.linear_num_key_heads})."
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})."
        )
    if config.hidden_act != "silu":
        raise ValueError(f"Only hidden_act='silu' is supported, got {config.hidden_act!r}.")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Only the default rope type is supported, got {rope.get('rope_type')!r}.")


def rotary_dim(config: PretrainedConfig) -> int:
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    return int(config.head_dim * factor)
