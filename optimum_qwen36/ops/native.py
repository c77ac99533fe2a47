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
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = (Path(__file__).parent / "csrc" / "fp8_linear.cpp",)
# AVX2 + FMA + F16C where the CPU has all three (the kernels' vector path), else portable scalar code.
VECTOR_FLAGS = {"avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c"}


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


def build_flags() -> list[str]:
    flags = cpu_flags()
    vector = [flag for name, flag in VECTOR_FLAGS.items() if name in flags]
    return ["-O3", *(vector if len(vector) == len(VECTOR_FLAGS) else [])]


def extension_name() -> str:
    """Unique per (torch version, compile flags, sources)."""
    digest = hashlib.sha256()
    digest.update(torch.__version__.encode())
    digest.update(" ".join(build_flags()).encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return f"optimum_qwen36_cpu_{digest.hexdigest()[:12]}"


@functools.cache
def load_native_ops() -> bool:
    """Compile (first time) and load the extension, registering `torch.ops.optimum_qwen36.*`; False, with a
    warning, when it cannot be built here."""
    from torch.utils.cpp_extension import load

    try:
        load(
            name=extension_name(),
            sources=[str(s) for s in SOURCES],
            extra_cflags=build_flags(),
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # no compiler, no headers: fall back to the PyTorch twins
        logger.warning(
            "The native CPU kernels could not be built (%s: %s); FP8 linear layers run their PyTorch "
            "twin, which computes the same values more slowly.",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        return False
    _register_fake_kernels()
    return True


def _register_fake_kernels() -> None:
    """Output shapes for torch.export / Inductor, which trace the ops without running them."""

    @torch.library.register_fake("optimum_qwen36::fp8_linear")
    def _(x, weight, scale_inv, block_rows, block_cols):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
