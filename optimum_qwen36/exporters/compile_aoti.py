"""Compiling the `cpu` / `cuda` backend: which steps it compiles, how their kernels and linear layers are
traced, and compiling them by regions into the compile cache (or a temporary directory). The steps run in
backends/aoti.py.

On cpu the linear layers of every step but prefill are traced as matvec.DecodeLinears says: the native bf16
kernel, or, on one row, a matrix-vector product; both stream the weights faster than ATen's matrix-matrix
kernels (prefill's: `linears_mode`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from ..backends.aoti import (
    EXTRA_CONSTANTS,
    SPECULATIVE_BATCHED_STEPS,
    SPECULATIVE_ROW_STEPS,
    STEP_SHAPES,
    AOTIBackend,
)
from ..backends.base import PREFILL_SNAPSHOTS
from ..backends.regions import StepShapes
from ..network.cache import CacheStorage
from ..network.model import Qwen36ForCausalLM
from ..network.neuron_config import Qwen36NeuronConfig
from ..ops.attention import (
    paged_attention_native,
    paged_attention_torch,
    paged_attention_varlen_native,
    paged_attention_varlen_torch,
)
from ..ops.conv import (
    causal_conv1d_decode,
    causal_conv1d_decode_native,
    causal_conv1d_varlen,
    causal_conv1d_varlen_native,
)
from ..ops.gdn import (
    gdn_decode_step_native,
    gdn_decode_step_torch,
    gdn_prefill_chunk_native,
    gdn_prefill_chunk_torch,
    gdn_verify_step_native,
    gdn_verify_step_torch,
    native_chunk_supported,
)
from ..ops.native import (
    bf16_linear_vectorized,
    bf16_matmul_instructions,
    gdn_prefill_vectorized,
    load_native_ops,
)
from .compile_cache import CompileCache, compile_key
from .example_args import example_step_args
from .matvec import DecodeLinears, WidenedLinears
from .regions import compile_regions

logger = logging.getLogger(__name__)


def graphs_to_compile(neuron_config: Qwen36NeuronConfig) -> list[str]:
    """The one-row steps for a batch of one row, else the batched ones only: a row's decode (verify, draft)
    is then the same computation whatever else runs with it (batch invariance: one-row graphs, compiled
    apart, may round differently), and one row runs padded to two (`min_step_rows`; a compiled dynamic
    batch starts at 2 rows, `regions._dims`)."""
    speculative = neuron_config.num_speculative_tokens > 0
    if neuron_config.batch_size == 1:
        return ["prefill_chunk", "decode_row", *(SPECULATIVE_ROW_STEPS if speculative else ())]
    return ["prefill_chunk", "decode_step", *(SPECULATIVE_BATCHED_STEPS if speculative else ())]


def compile_aoti_backend(
    model: Qwen36ForCausalLM,
    neuron_config: Qwen36NeuronConfig,
    cache: CompileCache | None,
    device: str,
) -> AOTIBackend:
    """Compile the step graphs into the compile cache (or take them from it; without one, into a temporary
    directory that lives as long as the backend) and return the backend running them, the model's weights
    bound."""
    backend = torch.device(device).type
    key = compile_key(model.config.to_dict(), neuron_config.to_dict(), backend)
    entry = cache.lookup(key) if cache is not None else None
    if entry is None:
        logger.info(
            "Compiling %s for %s (compile cache key %s): %s",
            ", ".join(graphs_to_compile(neuron_config)),
            device,
            key[:16],
            ", ".join(f"{k}={v}" for k, v in _describe(model, neuron_config).items()),
        )
        staging = Path(tempfile.mkdtemp(prefix="optimum-qwen36-compile-"))
        try:
            cpu_kernels = uses_cpu_kernels(backend)
            packs = prefill_takes_any_tokens(model, cpu_kernels)
            snapshots = PREFILL_SNAPSHOTS if packs else 0
            shapes = StepShapes(packs, decode_rows_in_prefill=packs, prefill_snapshots=snapshots)
            storage = CacheStorage.for_settings(model.config, neuron_config, device, snapshot_slots=snapshots)
            examples = example_step_args(neuron_config, storage, model.config.hidden_size, packs, snapshots)
            graphs = {graph: examples[graph] for graph in graphs_to_compile(neuron_config)}
            _compile_graphs(model, graphs, staging, cpu_kernels=cpu_kernels, shapes=shapes)
            if cache is not None:
                entry = cache.store(key, staging, _describe(model, neuron_config))
                shutil.rmtree(staging)
            else:
                entry = staging
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    else:
        logger.info("Reusing compiled graphs from %s", entry)
    instance = AOTIBackend(entry, model, device)
    if cache is None:
        # No cache to keep the files: they live as long as this backend.
        weakref.finalize(instance, shutil.rmtree, entry, True)
    return instance


def uses_cpu_kernels(device_type: str) -> bool:
    """Whether the graphs compiled for `device_type` call this package's native CPU ops where they build
    (attention, GDN, bf16 linears); elsewhere (cuda) they trace the ops' PyTorch twins."""
    return device_type == "cpu"


def prefill_takes_any_tokens(model: Qwen36ForCausalLM, cpu_kernels: bool) -> bool:
    """Whether the prefill graphs take 2..chunk tokens of packed sequences (each chunk's valid tokens,
    several running requests' chunks in one call) rather than one sequence's whole chunk: where the GDN
    layers' chunked delta rule is the native op (cpu, its vector build, head sizes it takes). The PyTorch
    form (cuda, other CPUs) walks 64-token blocks in Python, so its export would specialise the token
    count. Decided at export and recorded with the graphs (`STEP_SHAPES`)."""
    config = model.config
    return (
        cpu_kernels
        and gdn_prefill_vectorized()
        and native_chunk_supported(config.linear_key_head_dim, config.linear_value_head_dim)
    )


def linears_mode(step: str, native_bf16: bool, bf16_matmul: bool) -> TorchFunctionMode | None:
    """How `step`'s linear layers are traced on cpu: prefill_chunk's bf16 ones as float32 products of the
    widened values where the CPU has no bf16 matrix instructions (`bf16_matmul` False: matvec.WidenedLinears,
    through the native bf16 kernel when `native_bf16`), else as they are; every other step as
    matvec.DecodeLinears says (the native bf16 kernel for bf16 weights when `native_bf16`, float32 weights
    as weight @ x.T); decode_row (the one graph whose shapes are all static: the other one-row graphs take
    a dynamic number of positions) writes its other linears as matrix-vector products."""
    if step == "prefill_chunk":
        return None if bf16_matmul else WidenedLinears(native_bf16)
    return DecodeLinears(native_bf16, static_rows=step == "decode_row")


def _compile_graphs(
    model: Qwen36ForCausalLM,
    graphs: dict[str, tuple[torch.Tensor, ...]],
    out_dir: Path,
    cpu_kernels: bool,
    shapes: StepShapes,
) -> None:
    """Compile the regions of each step (name -> example arguments) into out_dir, taking `shapes`.
    With cpu_kernels, where the native ops build: attention calls `optimum_qwen36::paged_attention`, GDN
    layers `optimum_qwen36::gdn_decode_step` / `gdn_prefill_chunk`, and the linear layers of every step but
    prefill_chunk are traced as matvec.DecodeLinears says (prefill_chunk's as `linears_mode` says)."""
    total = time.perf_counter()
    native_bf16 = cpu_kernels and bf16_linear_vectorized()
    bf16_matmul = bf16_matmul_instructions()
    if cpu_kernels and load_native_ops():
        # The chunked delta rule's scalar build is slower than the compiled PyTorch twin; packed prefill
        # steps (whose conv is varlen) exist only with its vector build.
        vectorized = gdn_prefill_vectorized()
        model.set_kernels(
            paged_attention_native,
            paged_attention_varlen_native,
            gdn_decode_step_native,
            gdn_prefill_chunk_native if vectorized else gdn_prefill_chunk_torch,
            gdn_verify_step_native,
            causal_conv1d_varlen_native if vectorized else causal_conv1d_varlen,
            causal_conv1d_decode_native,
        )
    try:
        extra = compile_regions(
            model,
            graphs,
            out_dir,
            lambda step: linears_mode(step, native_bf16, bf16_matmul) if cpu_kernels else None,
            shapes,
        )
    finally:
        model.set_kernels(
            paged_attention_torch,
            paged_attention_varlen_torch,
            gdn_decode_step_torch,
            gdn_prefill_chunk_torch,
            gdn_verify_step_torch,
            causal_conv1d_varlen,
            causal_conv1d_decode,
        )
    if extra:
        save_file(extra, out_dir / EXTRA_CONSTANTS)
    (out_dir / STEP_SHAPES).write_text(json.dumps(dataclasses.asdict(shapes)))
    logger.info("Compiled %s in %.1f s", ", ".join(graphs), time.perf_counter() - total)


def _describe(model: Qwen36ForCausalLM, neuron_config: Qwen36NeuronConfig) -> dict[str, Any]:
    settings = neuron_config.to_dict()
    return {
        "model_type": model.config.model_type,
        "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        **{k: settings[k] for k in ("backend", "batch_size", "sequence_length", "prefill_chunk_size")},
        "dtype": settings["dtype"],
    }
