"""Compile several exported programs at once: worker processes and this process share the list.

AOTInductor spends most of a region graph's compile time in single-threaded work (Python code generation,
then g++ on the wrapper: ~5 s for any graph, the AOTI runtime headers' inline code). A model's steps are
several independent graphs, so they compile side by side on a machine's cores. Workers are fresh
interpreters (`python -m optimum_qwen36.exporters.compile_workers`), not threads (Inductor's configuration
and tracing state are process-global) and not multiprocessing children (which would re-run the user's
`__main__`). They start with the pool and take programs as they are exported (saved with
`torch.export.save`); this process joins in once every program is submitted. A worker writes the same
package this process would have written.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from tqdm.auto import tqdm

from ..network.sharding import stand_in_group
from . import aoti
from .aoti import bound_constants, package_program

logger = logging.getLogger(__name__)

NATIVE_NAMESPACE = "optimum_qwen36"
COLLECTIVES_NAMESPACE = "_c10d_functional"
WORKER_COMMAND = (sys.executable, "-m", __name__)


class CompileWorkerError(RuntimeError):
    """A worker process failed to compile a program, or died."""


WORKERS_VARIABLE = "OPTIMUM_QWEN36_COMPILE_WORKERS"


def default_workers(graphs: int) -> int:
    """Worker processes for compiling `graphs` graphs: $OPTIMUM_QWEN36_COMPILE_WORKERS if set (0: compile
    in this process only), else one per available CPU beyond this process's, and no more than graphs - 1."""
    value = os.environ.get(WORKERS_VARIABLE)
    if value is not None:
        if not value.isdigit():
            raise ValueError(
                f"{WORKERS_VARIABLE}={value!r}: expected the number of compile worker processes beside this "
                "one, 0 or more (0 compiles every graph in this process)."
            )
        return int(value)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(0, min(cpus, graphs) - 1)


def calls_native_ops(program: torch.export.ExportedProgram) -> bool:
    """Whether the program calls `torch.ops.optimum_qwen36.*` (a worker loads them before it loads it).
    A mutating op may appear as the first argument of a functionalization wrapper."""
    return any(
        isinstance(op, torch._ops.OpOverload) and op.namespace == NATIVE_NAMESPACE
        for node in program.graph.nodes
        if node.op == "call_function"
        for op in (node.target, *node.args[:1])
    )


def process_groups_called(program: torch.export.ExportedProgram) -> dict[str, tuple[int, int]]:
    """The process groups the program's collectives name (`_c10d_functional` ops), each with this process's
    rank in it and its size as registered now: Inductor asks the group for its size, so a worker compiles
    the program with a stand-in of the same rank and size (`tensor_parallel.stand_in_group`)."""
    names = set()
    for node in program.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if op.namespace == COLLECTIVES_NAMESPACE:
            arguments = dict(zip((a.name for a in op._schema.arguments), node.args, strict=False))
            arguments.update(node.kwargs)
            if "group_name" in arguments:  # wait_tensor names none
                names.add(arguments["group_name"])
    groups = {name: dist.distributed_c10d._resolve_process_group(name) for name in sorted(names)}
    return {name: (group.rank(), group.size()) for name, group in groups.items()}


@dataclass(frozen=True)
class _Job:
    program: torch.export.ExportedProgram
    package: Path
    saved: Path | None  # the program as a worker loads it (None without workers)
    devices: list[str | None]  # of its flat example inputs, which are saved as meta tensors


class CompilePool:
    """`aoti.package_program` for each submitted (program, package path): `workers` worker processes take
    them as they come, and `finish()` compiles what is left in this process, waits for the workers, and
    returns `aoti.bound_constants` of each program in submission order.

    Use as a context manager: leaving it early (an export failed) stops the workers."""

    def __init__(self, workers: int, total: int, inductor_configs: Mapping[str, Any] | None = None) -> None:
        # Resolved here: a worker compiles with this process's Inductor settings, whatever changed them.
        self._configs = {**aoti.DEFAULT_INDUCTOR_CONFIGS, **(inductor_configs or {})}
        self._jobs: list[_Job] = []
        self._pending: collections.deque[int] = collections.deque()
        self._submitted_all = False
        self._errors: list[BaseException] = []
        self._changed = threading.Condition()
        self._scratch = tempfile.TemporaryDirectory(prefix="optimum-qwen36-programs-")
        self._inductor_config = Path(self._scratch.name) / "inductor_config.pickle"
        if workers > 0:
            self._inductor_config.write_bytes(torch._inductor.config.save_config())
        self._progress = tqdm(total=total, desc="Compiling graphs", unit="graph", disable=None)
        self._threads = [threading.Thread(target=self._drive_worker) for _ in range(max(workers, 0))]
        for thread in self._threads:
            thread.start()

    def submit(self, program: torch.export.ExportedProgram, package_path: Path) -> None:
        index = len(self._jobs)
        saved = None
        devices: list[str | None] = []
        if self._threads:  # saved here, not in a worker's thread: torch.export state is not thread-safe
            saved = Path(self._scratch.name) / f"{index}.program.pt2"
            devices = _save_without_example_values(program, saved)
        with self._changed:
            self._jobs.append(_Job(program, package_path, saved, devices))
            self._pending.append(index)
            self._changed.notify()

    def finish(self) -> list[dict[str, torch.Tensor]]:
        with self._changed:
            self._submitted_all = True
            self._changed.notify_all()
        try:
            while (index := self._take(wait=False)) is not None:
                job = self._jobs[index]
                start = time.perf_counter()
                package_program(job.program, job.package, self._configs)
                logger.info("Compiled %s in %.1f s", job.package.name, time.perf_counter() - start)
                self._progress.update()
        except BaseException as error:
            self._fail(error)
            raise
        finally:
            self._stop()
        if self._errors:
            raise self._errors[0]
        return [bound_constants(job.program, job.package) for job in self._jobs]

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is not None:
            self._fail(error)
        self._stop()

    def _take(self, wait: bool) -> int | None:
        with self._changed:
            while wait and not self._pending and not self._submitted_all and not self._errors:
                self._changed.wait()
            if self._errors or not self._pending:
                return None
            return self._pending.popleft()

    def _fail(self, error: BaseException) -> None:
        with self._changed:
            self._errors.append(error)
            self._changed.notify_all()

    def _stop(self) -> None:
        with self._changed:
            self._submitted_all = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._progress.close()
        self._scratch.cleanup()

    def _drive_worker(self) -> None:
        """Start a worker process and hand it programs until none is left (runs in a thread)."""
        package_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        with tempfile.TemporaryFile(mode="w+") as stderr:
            try:
                worker = subprocess.Popen(
                    WORKER_COMMAND,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    env={**os.environ, "PYTHONPATH": pythonpath},
                )
            except OSError as error:  # e.g. no new processes allowed: this process compiles them all
                logger.warning("Could not start a compile worker process (%s): compiling here instead", error)
                return
            try:
                while (index := self._take(wait=True)) is not None:
                    job = self._jobs[index]
                    logger.debug("Compiling %s in worker process %d", job.package.name, worker.pid)
                    request = {
                        "program": str(job.saved),
                        "devices": job.devices,
                        "inductor_config": str(self._inductor_config),
                        "package": str(job.package),
                        "configs": self._configs,
                        "native_ops": calls_native_ops(job.program),
                        "process_groups": process_groups_called(job.program),
                    }
                    reply = _ask(worker, request, stderr)
                    if "error" in reply:
                        raise CompileWorkerError(
                            f"Compiling {job.package.name} in a worker process failed:\n{reply['error']}"
                        )
                    logger.info("Compiled %s in %.1f s (worker process)", job.package.name, reply["seconds"])
                    self._progress.update()
            except BaseException as error:
                self._fail(error)
            finally:
                if worker.stdin is not None:
                    worker.stdin.close()
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()


def _save_without_example_values(program: torch.export.ExportedProgram, path: Path) -> list[str | None]:
    """torch.export.save with the example inputs as meta tensors: they are the caches (hundreds of MB) and
    AOTInductor reads only their shapes, strides, dtypes and devices. Returns the flat inputs' devices."""
    example = program.example_inputs
    flat, _ = pytree.tree_flatten(example)
    program.example_inputs = pytree.tree_map_only(
        torch.Tensor,
        lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
        example,
    )
    try:
        torch.export.save(program, path)
    finally:
        program.example_inputs = example
    return [str(t.device) if isinstance(t, torch.Tensor) else None for t in flat]


def _restore_example_inputs(program: torch.export.ExportedProgram, devices: list[str | None]) -> None:
    """Uninitialised tensors in place of the meta example inputs, on their devices (never read)."""
    flat, spec = pytree.tree_flatten(program.example_inputs)
    program.example_inputs = pytree.tree_unflatten(
        [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if isinstance(t, torch.Tensor)
            else t
            for t, device in zip(flat, devices, strict=True)
        ],
        spec,
    )


def _ask(worker: subprocess.Popen, job: dict[str, Any], stderr: IO[str]) -> dict[str, Any]:
    """Send one job, wait for its reply line; a worker that exits instead is an error with its stderr."""
    assert worker.stdin is not None and worker.stdout is not None
    try:
        worker.stdin.write(json.dumps(job) + "\n")
        worker.stdin.flush()
        line = worker.stdout.readline()
    except BrokenPipeError:
        line = ""
    if not line:
        worker.wait()
        stderr.seek(0)
        tail = stderr.read()[-4000:]
        raise CompileWorkerError(
            f"A compile worker process exited (status {worker.returncode}) while compiling "
            f"{Path(job['package']).name}. Its last output:\n{tail}"
        )
    return json.loads(line)


def _serve() -> None:
    """Worker: read one job per line on stdin, compile it, answer one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to stderr, off the reply channel
    for line in sys.stdin:
        job = json.loads(line)
        try:
            start = time.perf_counter()
            if job["native_ops"]:
                from ..ops.native import load_native_ops

                if not load_native_ops():
                    raise RuntimeError("the native CPU kernels the program calls could not be loaded here")
            torch._inductor.config.load_config(Path(job["inductor_config"]).read_bytes())
            program = torch.export.load(job["program"])
            _restore_example_inputs(program, job["devices"])
            with contextlib.ExitStack() as groups:
                for name, (rank, size) in job["process_groups"].items():
                    groups.enter_context(stand_in_group(rank, size, name))
                package_program(program, job["package"], job["configs"])
            reply: dict[str, Any] = {"seconds": time.perf_counter() - start}
        except Exception:
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    _serve()
