"""Timing helpers shared by the benchmark scripts: repeated runs, the sides of a comparison alternated, and
the spread (min / median / max, every run kept) that the JSON records. The median is the headline figure:
on a shared machine the minimum is a lucky run and the maximum an unlucky one; both are kept beside it.
Also how a peer (vLLM-CPU) is run in its own Python and environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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


def portable(text: str) -> str:
    """`text` with this user's home directory written as $HOME (commands recorded in the JSON)."""
    return text.replace(str(Path.home()), "$HOME")


def command_line() -> str:
    """How this benchmark was started, with the OpenMP wait policy when one was set."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    return portable(" ".join([f"OMP_WAIT_POLICY={policy}"] * bool(policy) + ["python", *sys.argv]))


VLLM_PYTHON_ENV = "OPTIMUM_QWEN36_VLLM_PYTHON"
VLLM_SETUP_ENV = "OPTIMUM_QWEN36_VLLM_ENV"


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """--vllm-python and --vllm-env, with their environment variables as defaults."""
    parser.add_argument(
        "--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV), help=f"vLLM's Python (${VLLM_PYTHON_ENV})"
    )
    parser.add_argument(
        "--vllm-env",
        default=os.environ.get(VLLM_SETUP_ENV),
        help=f"a bash script sourced before vLLM starts, e.g. peers/vllm_env.sh (${VLLM_SETUP_ENV})",
    )


def peer_command(program: list[str], setup_script: str | None) -> list[str]:
    """`program` run by bash after sourcing `setup_script`, where one is given: a peer's environment (vLLM-CPU
    needs an LD_PRELOAD and stub libraries) then reaches the peer's process only, not this benchmark's."""
    if not setup_script:
        return program
    return ["bash", "-c", '. "$0" && exec "$@"', setup_script, *program]


class PeerProcess:
    """A peer (`name`)'s Python running `script` (which loads the peer from the JSON spec named by argv[1],
    prints `VLLM_READY <json>`, then answers each line of its stdin with one `<marker> <json>` line) in its
    own process and environment, kept loaded between measurements: each runs right after ours, and this
    shared machine's speed drifts over minutes. `ready` is the JSON of its ready line. A peer that fails says
    so with the end of its stderr; `close` (also on failure) ends the process and removes its files."""

    def __init__(self, name: str, script: str, spec: dict, python: str, setup_script: str | None) -> None:
        self.name = name
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        self._spec_path: str | None = f.name
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read when the process fails, closed in close())
        self._process = subprocess.Popen(
            peer_command([python, "-c", script, f.name], setup_script),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        try:
            self.ready = self._read("VLLM_READY ")
        except BaseException:
            self.close()
            raise

    def request(self, line: str, marker: str) -> dict:
        """Send one line; the JSON of the answer line that starts with `marker`."""
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        return self._read(marker)

    def close(self) -> None:
        """End the process (its stdin closed, killed if it has not exited within 2 minutes) and remove its
        files; closing again does nothing."""
        if self._spec_path is None:
            return
        try:
            if self._process.poll() is None:
                self._process.stdin.close()
                try:
                    self._process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
        finally:
            self._stderr.close()
            os.unlink(self._spec_path)
            self._spec_path = None

    def _read(self, marker: str) -> dict:
        for line in self._process.stdout:
            if line.startswith(marker):
                return json.loads(line.removeprefix(marker))
        self._stderr.seek(0)
        stderr = self._stderr.read()[-3000:]
        raise RuntimeError(f"{self.name} failed (exit {self._process.wait()}):\n{stderr}")
