"""Build and load the native CPU kernels (`csrc/`) as torch custom ops, once per machine kind.

The extension is compiled on first use with torch's own C++ extension builder and cached (under
$TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Its name carries the torch version and the
instruction set it is compiled for, so a cache shared between CPUs of different kinds never hands one the
other's binary. Where no compiler is available the build fails once, with a warning, and every caller
uses the PyTorch twin instead (same results, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

KERNELS = (
    "fp8_linear.cpp",
    "int4_linear.cpp",
    "bf16_linear.cpp",
    "paged_attention.cpp",
    "gdn_decode.cpp",
    "gdn_prefill.cpp",
    "causal_conv.cpp",
)
SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in KERNELS)
# Everything the extension is built from (its name and the compile cache key hash these).
FILES = (
    *SOURCES,
    *(
        Path(__file__).parent / "csrc" / h
        for h in ("vec_math.h", "gdn_state.h", "denormals.h", "amx.h", "dequantized_product.h")
    ),
)
# Each kernel's vector path is compiled where the CPU has every extension of its set, else portable scalar
# code: AVX2 + FMA + F16C (fp8_linear's float32 path, bf16_linear's and the GDN prefill's AVX2 paths),
# AVX-512 with BF16 dot products (bf16_linear, attention, the GDN prefill), plus VBMI's byte tables
# (fp8_linear's bf16 decode path) and AMX tiles (bf16_linear's decode rows).
VECTOR_FLAGS = {"avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c"}
BF16_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512_bf16": "-mavx512bf16"}
BYTE_TABLE_FLAGS = {"avx512vbmi": "-mavx512vbmi"}
# bf16_linear's tile path (with the AVX-512 BF16 set), where the compiler and assembler know them.
TILE_FLAGS = {"amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16"}
TILE_PROBE = "#include <immintrin.h>\nvoid release_tiles() { _tile_release(); }\n"

# What ATen's bf16 matrix product (oneDNN) needs to run near its float32 speed.
BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _all_or_none(wanted: dict[str, str], flags: set[str]) -> list[str]:
    return list(wanted.values()) if wanted.keys() <= flags else []


def build_flags() -> list[str]:
    """-fopenmp: ATen's parallel_for, inlined into the kernels, runs its loop on one thread without it."""
    flags = cpu_flags()
    bf16 = _all_or_none(BF16_FLAGS, flags)
    byte_tables = _all_or_none(BYTE_TABLE_FLAGS, flags) if bf16 else []
    tiles = _all_or_none(TILE_FLAGS, flags) if bf16 else []
    if tiles and not compiles(TILE_PROBE, tuple(tiles)):
        tiles = []
    return ["-O3", "-fopenmp", *_all_or_none(VECTOR_FLAGS, flags), *bf16, *byte_tables, *tiles]


@functools.cache
def compiles(source: str, flags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler of torch's extension builder compiles and assembles `source` with `flags`
    (GCC before 11 or binutils before 2.36 reject AMX's: the whole extension would then fail to build)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    command = [get_cxx_compiler(), *flags, "-x", "c++", "-c", "-", "-o", os.devnull]
    try:
        result = subprocess.run(command, input=source, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0


def gdn_prefill_vectorized() -> bool:
    """Whether `gdn_prefill_chunk` is built with a float32 vector path here (AVX-512, or AVX2 + FMA): its
    scalar build is slower than the compiled PyTorch twin, so callers then keep that."""
    flags = build_flags()
    vector = BF16_FLAGS["avx512f"] in flags or {VECTOR_FLAGS["avx2"], VECTOR_FLAGS["fma"]} <= set(flags)
    return vector and load_native_ops()


def bf16_matmul_instructions() -> bool:
    """Whether this CPU has bf16 matrix instructions for ATen's bf16 matrix product (True where
    /proc/cpuinfo cannot be read: nothing is known to be slow then)."""
    flags = cpu_flags()
    return not flags or bool(flags & set(BF16_MATMUL_FLAGS))


def bf16_linear_vectorized() -> bool:
    """Whether `optimum_qwen36::bf16_linear` is built with a vector path here (AVX-512 BF16 dot products,
    or AVX2 + FMA on widened values): then it streams a bf16 weight faster than ATen's F.linear for up to
    16 rows (benchmarks/bench_matvec.py); its scalar fallback does not, and callers keep F.linear."""
    flags = build_flags()
    vector = BF16_FLAGS["avx512_bf16"] in flags or {VECTOR_FLAGS["avx2"], VECTOR_FLAGS["fma"]} <= set(flags)
    return vector and load_native_ops()


def layer_index(cache_idx: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A cache entry index as the native ops take it: an int64 tensor [1] (a graph shared by layers already
    passes one)."""
    return torch.tensor([cache_idx], device=device) if isinstance(cache_idx, int) else cache_idx


def extension_name() -> str:
    """Unique per (torch version, compile flags, sources)."""
    digest = hashlib.sha256()
    digest.update(torch.__version__.encode())
    digest.update(" ".join(build_flags()).encode())
    for source in FILES:
        digest.update(source.read_bytes())
    return f"optimum_qwen36_cpu_{digest.hexdigest()[:12]}"


def build_extension(
    label: str, name: str, sources: Sequence[Path], cflags: list[str], python_module: bool, fallback: str
) -> tuple[bool, Any]:
    """Compile (first time, cached like torch's C++ extensions) and load the extension `name` with torch's
    builder: (True, the module where `python_module`, else None). Where it cannot be built here (no
    compiler, no headers): (False, None), with a warning that names it (`label`) and says what runs instead
    (`fallback`)."""
    from torch.utils.cpp_extension import load

    try:
        module = load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            is_python_module=python_module,
            verbose=False,
        )
    except Exception as error:
        logger.warning(
            "%s could not be built (%s: %s); %s",
            label,
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
            fallback,
        )
        return False, None
    return True, module


@functools.cache
def load_native_ops() -> bool:
    """Compile (first time) and load the extension, registering `torch.ops.optimum_qwen36.*`; False, with a
    warning, when it cannot be built here."""
    built, _ = build_extension(
        "The native CPU kernels",
        extension_name(),
        SOURCES,
        build_flags(),
        python_module=False,
        fallback="FP8 and 4-bit linear layers run their PyTorch twins, which compute the same values more "
        "slowly, bf16 decode steps ATen's F.linear, and attention reads the whole block table under a mask.",
    )
    if built:
        _register_fake_kernels()
    return built


def _register_fake_kernels() -> None:
    """Output shapes for torch.export / Inductor, which trace the ops without running them."""

    @torch.library.register_fake("optimum_qwen36::fp8_linear")
    def _(x, weight, scale_inv, block_rows, block_cols):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("optimum_qwen36::int4_linear")
    def _(x, packed, scales, zeros, group_size):
        return x.new_empty((*x.shape[:-1], packed.shape[0]))

    @torch.library.register_fake("optimum_qwen36::bf16_linear")
    def _(x, weight, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("optimum_qwen36::gdn_decode_step")
    def _(q, k, v, g, beta, recurrent_state, cache_idx, slots, scale):
        return torch.empty_like(v, memory_format=torch.contiguous_format)

    @torch.library.register_fake("optimum_qwen36::gdn_verify_step")
    def _(q, k, v, g, beta, recurrent_state, spec_recurrent_state, cache_idx, slots, scale):
        return torch.empty_like(v, memory_format=torch.contiguous_format)

    @torch.library.register_fake("optimum_qwen36::gdn_prefill_chunk")
    def _(
        q,
        k,
        v,
        g,
        beta,
        recurrent_state,
        cache_idx,
        slots,
        cu_seqlens,
        scale,
        snapshot_ends=None,
        snapshot_slots=None,
    ):
        return torch.empty_like(v, memory_format=torch.contiguous_format)

    @torch.library.register_fake("optimum_qwen36::causal_conv1d_varlen")
    def _(x, weight, conv_state, head_tokens, head_taps, conv_tail):
        states = conv_state.new_empty((conv_tail.shape[0], *conv_state.shape[1:]))
        return torch.empty_like(x, memory_format=torch.contiguous_format), states

    @torch.library.register_fake("optimum_qwen36::causal_conv1d_decode")
    def _(x, weight, conv_state, cache_idx, slots):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("optimum_qwen36::paged_attention")
    def _(query, key_cache, value_cache, cache_idx, block_tables, positions, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    @torch.library.register_fake("optimum_qwen36::paged_attention_varlen")
    def _(query, key_cache, value_cache, cache_idx, block_tables, cu_seqlens, positions, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)
