"""Running an AOTInductor package (`.pt2`) with the model's weights bound at load.

The weights are not compiled into the package (exporters/aoti.py): they stay in safetensors files and are
handed to the loaded runner with `load_constants(..., user_managed=True)`, which keeps our (memory-mapped)
tensors instead of copying them. One set of weight tensors then serves every graph of a model.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..ops.native import build_extension

# Prefix of the model's names inside the wrapper a graph was exported from (exporters/aoti.py): a graph's
# constants are named "model.<name>".
WRAPPED_PREFIX = "model."


def unwrapped(name: str) -> str:
    """A graph constant's name as the model's own."""
    return name.removeprefix(WRAPPED_PREFIX)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it has (tied weights appear under each name)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return {name: t.detach() for name, t in tensors.items()}


GRAPH_RUNNER_SOURCE = Path(__file__).parent / "csrc" / "graph_runner.cpp"


@functools.cache
def graph_runner_module() -> Any:
    """The extension whose `GraphRunner` runs a package with the GIL released (built on first use, cached
    like torch's C++ extensions); None, with a warning, where it cannot be built."""
    digest = hashlib.sha256(torch.__version__.encode() + GRAPH_RUNNER_SOURCE.read_bytes()).hexdigest()[:12]
    _, module = build_extension(
        "The graph runner",
        f"optimum_qwen36_graph_runner_{digest}",
        [GRAPH_RUNNER_SOURCE],
        ["-O2"],
        python_module=True,
        fallback="compiled graphs run through torch's loader, which holds the GIL while a graph runs (other "
        "Python threads wait for it).",
    )
    return module


def graph_runner_releases_gil() -> bool:
    """Whether compiled graphs run with the GIL released here (tensor parallelism needs it: a rank's gloo
    thread takes the GIL to drop a finished collective's tensors while a graph waits on the next one)."""
    return graph_runner_module() is not None


class CompiledGraph:
    """A loaded `.pt2` with its weights bound; call it with the flat tensor arguments of the method. It runs
    with the GIL released where the graph runner extension builds (`graph_runner_module`)."""

    def __init__(
        self, package_path: str | os.PathLike, constants: Mapping[str, torch.Tensor], device: str = "cpu"
    ) -> None:
        device_index = torch.device(device).index
        device_index = -1 if device_index is None else device_index
        # A graph checks its inputs' dtypes, sizes and strides against what it was compiled for only where
        # this is set (read at its first call); unchecked, a mismatched call reads past its tensors.
        os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")
        module = graph_runner_module()
        if module is not None:
            runner = module.GraphRunner(str(package_path), device_index=device_index)
        else:
            runner = torch._inductor.aoti_load_package(str(package_path), device_index=device_index).loader
        # Constants are named as in the wrapper the graph was exported from ("model.<name>").
        needed = runner.get_constant_fqns()
        missing = sorted(unwrapped(n) for n in needed if unwrapped(n) not in constants)
        if missing:
            # A runner called with unbound constants crashes the process (segfault): refuse here instead.
            raise KeyError(
                f"{package_path} needs weights that were not provided: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}. The weights file does not belong to this graph: "
                "re-export the model."
            )
        bound = {name: constants[unwrapped(name)] for name in needed}
        # user_managed: the runner keeps pointers to our tensors (no copy); we keep them alive in self.
        runner.load_constants(bound, False, True, True)  # use_inactive, check_full_update, user_managed
        self._constants = bound
        # run() directly: no pytree flatten/unflatten as in torch's runner.__call__ (~0.2 ms per call).
        self._runner = runner
        self.package_path = str(package_path)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        try:
            outputs = self._runner.run(list(args))
        except RuntimeError as error:
            if "input_handles" not in str(error):  # not the input check's
                raise
            shapes = [(tuple(arg.shape), arg.stride(), str(arg.dtype)) for arg in args]
            raise RuntimeError(
                f"{self.package_path} was called with inputs it was not compiled for ({error}); inputs "
                f"(shape, stride, dtype): {shapes}"
            ) from error
        return outputs[0] if len(outputs) == 1 else outputs

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._runner.get_metadata())
