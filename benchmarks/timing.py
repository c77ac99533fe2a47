"""Timing helpers shared by the benchmark scripts: repeated runs, the sides of a comparison alternated, and
the spread (min / median / max, every run kept) that the JSON records. The median is the headline figure:
on a shared machine the minimum is a lucky run and the maximum an unlucky one; both are kept beside it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from optimum_qwen36.exporters.artifact import cpu_isa


def spread(values: Sequence[float]) -> dict:
    """{"min", "median", "max", "runs"} of repeated measurements (every run kept, in order)."""
    if not values:
        raise ValueError("spread() of no runs")
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "runs": list(values),
    }


def machine() -> dict:
    """What ran a benchmark: the CPU (model and the SIMD extensions that decide its bf16 / fp32 rates: without
    avx512_bf16 a bf16 matrix product is orders of magnitude slower), threads, OS and torch."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            model = next(names, model)
    except OSError:
        pass
    return {
        "cpu": model,
        "cpu_isa": cpu_isa(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
    }


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def wall(fn: Callable[[], object]) -> Callable[[], float]:
    """fn as a measurement: it returns the wall time of one call, waiting for GPU work it launched."""

    def timed() -> float:
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        return time.perf_counter() - start

    return timed


def alternate(measures: dict[str, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[str, list]:
    """Run each measurement (a callable returning seconds, e.g. ``wall(fn)``) ``warmup`` times, then
    ``repeats`` rounds in which every measurement runs once, in turn: on a shared machine alternating
    exposes the sides of a comparison to the same load. Returns the seconds of every timed run per name."""
    for measure in measures.values():
        for _ in range(warmup):
            measure()
    runs: dict[str, list] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            runs[name].append(measure())
    return runs


def rates(amount: float, seconds: Sequence[float]) -> dict:
    """spread() of amount / seconds for each run (e.g. tokens per second)."""
    return spread([amount / s for s in seconds])


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> dict:
    """spread() of the ratio of the two sides in each round of ``alternate`` (runs under similar load)."""
    return spread([a / b for a, b in zip(numerators, denominators, strict=True)])


def fmt(summary: dict, digits: int = 1, unit: str = "") -> str:
    """'median (min-max)' of a spread() for the printed tables."""
    return f"{summary['median']:.{digits}f}{unit} ({summary['min']:.{digits}f}-{summary['max']:.{digits}f})"
