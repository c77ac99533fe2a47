"""Whether this machine's torch loads a cuda AOTInductor package laid out as ours are: weights neither in the
.so nor in the package (`aot_inductor.package_constants_in_so=False`), bound at load. On an H200 with torch
2.11 the load crashed the process (segfault); the end-to-end cuda tests cannot pass where this fails.

    python3 .ci/aoti_cuda_load.py      # exit 0 when the package loads and computes the module's result
"""

import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import sys
import torch
sys.path.insert(0, {root!r})
from optimum_qwen36.backends.compiled_graph import CompiledGraph
from optimum_qwen36.exporters.aoti import DEFAULT_INDUCTOR_CONFIGS

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).cuda()
x = torch.randn(4, 64, device="cuda")
program = torch.export.export(model, (x,))
configs = DEFAULT_INDUCTOR_CONFIGS
torch._inductor.aoti_compile_and_package(program, package_path={path!r}, inductor_configs=configs)
print("compiled", flush=True)
graph = CompiledGraph({path!r}, {{name: t for name, t in model.state_dict().items()}}, "cuda:0")
print("loaded", flush=True)
print("max difference", (graph(x) - model(x)).abs().max().item(), flush=True)
"""

root = str(Path(__file__).resolve().parent.parent)
with tempfile.TemporaryDirectory() as directory:
    path = str(Path(directory) / "linear.pt2")
    result = subprocess.run([sys.executable, "-c", CHILD.format(root=root, path=path)], timeout=600)
print(f"cuda AOTInductor package with weights bound at load: exit code {result.returncode}")
sys.exit(result.returncode)
