"""Graphs compiled in a worker process are the ones this process would compile; failures are reported."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

from optimum_qwen36.backends.compiled_graph import CompiledGraph
from optimum_qwen36.exporters import compile_workers
from optimum_qwen36.exporters.aoti import bound_constants, export_method, package_program
from optimum_qwen36.exporters.compile_workers import CompilePool, CompileWorkerError, default_workers
from optimum_qwen36.ops.native import load_native_ops

LOGGER = "optimum_qwen36.exporters.compile_workers"


class NativeStep(torch.nn.Module):
    """A native op (the worker must load the extension) and Inductor-generated code around it, writing a
    large input in place (its example value is not shipped to the worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(48, 64, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.optimum_qwen36.bf16_linear(torch.rms_norm(x, (64,)), self.weight, None)
        cache.index_put_((rows,), y)
        return torch.nn.functional.silu(y) * 2


def _args() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    return x, torch.zeros(4096, 48, dtype=torch.bfloat16), torch.tensor([5, 7, 9])


def _wait_for(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in record.getMessage() for record in caplog.records):
        assert time.monotonic() < deadline, f"no log record with {text!r}"
        time.sleep(0.05)


@pytest.mark.skipif(not load_native_ops(), reason="the native extension does not build here")
def test_worker_compiles_what_this_process_would(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    model = NativeStep()
    program = export_method(model, "forward", _args())
    assert compile_workers.calls_native_ops(program)
    with CompilePool(workers=1, total=1) as pool:
        pool.submit(program, tmp_path / "worker.pt2")
        _wait_for(caplog, "in worker process")  # taken by the worker before this process could
        (constants,) = pool.finish()
    assert any(
        "worker.pt2" in r.getMessage() and "(worker process)" in r.getMessage() for r in caplog.records
    )
    package_program(program, tmp_path / "here.pt2")
    assert bound_constants(program, tmp_path / "here.pt2").keys() == constants.keys()
    assert _kernel_sources(tmp_path / "worker.pt2") == _kernel_sources(tmp_path / "here.pt2")

    outputs = {}
    for name in ("worker", "here"):
        args = _args()
        out = CompiledGraph(tmp_path / f"{name}.pt2", constants)(*args)
        outputs[name] = (out, args[1])
    assert torch.equal(outputs["worker"][0], outputs["here"][0])
    assert torch.equal(outputs["worker"][1], outputs["here"][1])  # the cache written in place, the same way
    with torch.no_grad():
        expected_cache = _args()[1]
        expected = model(_args()[0], expected_cache, _args()[2])
    torch.testing.assert_close(outputs["worker"][0], expected, rtol=2e-2, atol=2e-2)
    assert outputs["worker"][1][[5, 7, 9]].abs().sum() > 0


def _kernel_sources(package: Path) -> list[str]:
    """The generated kernels' C++ without comment and blank lines (comments name the build directory)."""
    with zipfile.ZipFile(package) as archive:
        sources = [archive.read(n).decode() for n in archive.namelist() if n.endswith(".kernel.cpp")]
    return sorted(
        "\n".join(ln for ln in s.splitlines() if ln.strip() and not ln.startswith("//")) for s in sources
    )


def test_worker_compiles_with_this_process_inductor_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    program = export_method(
        torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.SiLU()), "forward", (torch.randn(2, 8),)
    )
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}), CompilePool(1, total=1) as pool:
        pool.submit(program, tmp_path / "profiled.pt2")
        _wait_for(caplog, "in worker process")
        pool.finish()
    assert "RAIIAtenRecordFunctionHandle" in "".join(_kernel_sources(tmp_path / "profiled.pt2"))


def test_pool_compiles_in_this_process_without_workers(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    program = export_method(model, "forward", (x,))
    with CompilePool(workers=0, total=1) as pool:
        pool.submit(program, tmp_path / "linear.pt2")
        (constants,) = pool.finish()
    with torch.no_grad():
        torch.testing.assert_close(CompiledGraph(tmp_path / "linear.pt2", constants)(x), model(x))


def test_worker_failure_names_the_graph(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    (tmp_path / "a-file").write_text("not a directory")
    program = export_method(torch.nn.Linear(8, 4), "forward", (torch.randn(2, 8),))
    with CompilePool(workers=1, total=1) as pool:
        pool.submit(program, tmp_path / "a-file" / "never.pt2")
        _wait_for(caplog, "in worker process")
        with pytest.raises(CompileWorkerError, match=r"Compiling never.pt2 in a worker process failed"):
            pool.finish()


def test_a_worker_that_exits_is_an_error_with_its_output() -> None:
    script = "import sys; sys.stdin.readline(); print('out of memory', file=sys.stderr); sys.exit(3)"
    with tempfile.TemporaryFile(mode="w+") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        with pytest.raises(
            CompileWorkerError, match=r"(?s)exited \(status 3\) while compiling x.pt2.*out of memory"
        ):
            compile_workers._ask(worker, {"package": "/tmp/x.pt2"}, stderr)


def test_worker_count_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compile_workers.WORKERS_VARIABLE, "3")
    assert default_workers(8) == 3
    monkeypatch.setenv(compile_workers.WORKERS_VARIABLE, "two")
    with pytest.raises(ValueError, match="OPTIMUM_QWEN36_COMPILE_WORKERS='two'"):
        default_workers(8)
    monkeypatch.delenv(compile_workers.WORKERS_VARIABLE)
    assert default_workers(1) == 0
    assert 0 <= default_workers(8) <= 7


def test_a_worker_that_cannot_start_leaves_the_work_to_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compile_workers, "WORKER_COMMAND", (str(tmp_path / "no-such-python"),))
    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    with CompilePool(workers=1, total=1) as pool:
        pool.submit(export_method(model, "forward", (x,)), tmp_path / "here.pt2")
        (constants,) = pool.finish()
    assert "Could not start a compile worker process" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(CompiledGraph(tmp_path / "here.pt2", constants)(x), model(x))
