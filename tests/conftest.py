"""Tiny random Qwen3.5/3.6 checkpoints, saved with transformers, for tests that compare against it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

# Keep tests reproducible and light on a 2-core machine, and pytest-xdist's workers off each other's cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if _WORKERS > 1:  # the test workers already take the cores: compile every graph in its test's process
    os.environ.setdefault("OPTIMUM_QWEN36_COMPILE_WORKERS", "0")
    # One Inductor cache per worker: two processes compiling the same graph at once write the same cache
    # directory, and one can package the other's half-written files.
    _worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _worker_cache = Path(tempfile.gettempdir()) / f"torchinductor-{_worker}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_worker_cache))

TINY_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    initializer_range=0.08,
    tie_word_embeddings=False,
)


# The image / video placeholder and delimiter tokens of the tiny vision-language checkpoints: inside their
# 512-token vocabulary (Qwen's own ids are beyond it).
TINY_VISION_TOKENS = dict(
    vision_start_token_id=505, vision_end_token_id=506, image_token_id=507, video_token_id=508
)
# Qwen's own vision token ids: a checkpoint with Qwen's vocabulary (the real tokenizer and chat template).
QWEN_VISION_TOKENS = dict(
    vision_start_token_id=248053, vision_end_token_id=248054, image_token_id=248056, video_token_id=248057
)


def tiny_text_config(**overrides: Any) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**{**TINY_TEXT_CONFIG, **overrides})


@torch.no_grad()
def strengthen_decays(model: torch.nn.Module, seed: int) -> None:
    """Real Qwen3.6 gates decay much faster than transformers' init: exp(A_log) up to 16 and large
    softplus inputs (dt_bias up to 6) give per-token log decays of tens, far below the defaults."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            n = module.A_log.numel()
            module.A_log.copy_(torch.empty(n).uniform_(0.0, 2.77, generator=generator))  # exp: 1..16
            module.dt_bias.copy_(torch.empty(n).uniform_(-2.0, 6.0, generator=generator))
        if type(module).__name__.endswith("RMSNorm") and not type(module).__name__.endswith("Gated"):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.2)


def save_tiny_checkpoint(
    directory: Path,
    layout: str = "causal",
    seed: int = 0,
    vision_tokens: dict[str, int] = TINY_VISION_TOKENS,
    **overrides: Any,
) -> tuple[Path, torch.nn.Module]:
    """Build a random transformers model (layout "causal" = Qwen3_5ForCausalLM, "conditional" =
    Qwen3_5ForConditionalGeneration with a tiny vision tower), save it, return (dir, fp32 model)."""
    torch.manual_seed(seed)
    text_config = tiny_text_config(**overrides)
    if layout == "causal":
        model = Qwen3_5ForCausalLM(text_config)
    elif layout == "conditional":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        config = Qwen3_5Config(
            text_config=text_config.to_dict(),
            vision_config=vision,
            tie_word_embeddings=text_config.tie_word_embeddings,
            **vision_tokens,
        )
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        raise ValueError(layout)
    strengthen_decays(model, seed)
    model.eval()
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Factory: tiny_checkpoint(layout="causal", seed=0, **config_overrides) -> (dir, transformers model)."""
    counter = iter(range(1000))

    def make(layout: str = "causal", seed: int = 0, **overrides: Any) -> tuple[Path, torch.nn.Module]:
        return save_tiny_checkpoint(tmp_path / f"ckpt{next(counter)}", layout, seed, **overrides)

    return make


def mtp_tensor_shapes(config: Qwen3_5TextConfig) -> dict[str, tuple[int, ...]]:
    """The 15 `mtp.*` tensors of Qwen3.5/3.6 checkpoints (transformers does not model them)."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim, inter = config.head_dim, config.intermediate_size
    layer = "mtp.layers.0."
    return {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
        layer + "input_layernorm.weight": (hidden,),
        layer + "post_attention_layernorm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (2 * heads * head_dim, hidden),  # query and gate per head
        layer + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": (head_dim,),
        layer + "self_attn.k_norm.weight": (head_dim,),
        layer + "mlp.gate_proj.weight": (inter, hidden),
        layer + "mlp.up_proj.weight": (inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
    }


def add_random_mtp_weights(directory: Path, config: Qwen3_5TextConfig, seed: int = 0) -> None:
    """Write random `mtp.*` weights next to a saved checkpoint, in the official key layout."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in mtp_tensor_shapes(config).items():
        scale = 0.2 if len(shape) == 1 else config.initializer_range
        tensors[name] = torch.randn(shape, generator=generator) * scale
    save_file(tensors, str(directory / "mtp.safetensors"))
