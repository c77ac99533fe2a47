"""The AOTInductor machinery on a toy module shaped like the model's steps (int64 scalar arguments, a paged
cache written with index_put_, a block gather): weights outside the package, in-place cache updates."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from optimum_qwen36.backends.compiled_graph import CompiledGraph
from optimum_qwen36.exporters.aoti import CopyingMutationError, compile_method

BLOCK, BLOCKS, HEADS, DIM, SLOTS = 4, 32, 2, 8, 3


class ToyStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, HEADS * DIM)  # 64 KB: far more than the code of its graph
        self.proj = nn.Linear(HEADS * DIM, HEADS * DIM, bias=False)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def step(self, ids, start_pos, slot, block_table, kv_cache, state):
        """ids [T]; start_pos, slot int64 scalars; block_table [max_blocks];
        kv_cache [2, BLOCKS, BLOCK, H, D]; state [2, SLOTS, D]. Writes K/V and the slot's state in place."""
        positions = start_pos + torch.arange(ids.shape[0])
        x = self.proj(self.embed(ids)).view(-1, HEADS, DIM)
        blocks = block_table[positions // BLOCK]
        layer = torch.full_like(blocks, 1)
        kv_cache.index_put_((layer, blocks, positions % BLOCK), x)
        gathered = kv_cache[1][block_table].flatten(0, 1)  # [max_blocks * BLOCK, H, D]
        slot_index = slot.reshape(1)
        new_state = state[1].index_select(0, slot_index) * self.scale + gathered.sum((0, 1))
        state.index_put_((torch.full_like(slot_index, 1), slot_index), new_state)
        return gathered.sum(-1)

    def step_through_views(self, ids, start_pos, slot, block_table, kv_cache, state):
        state[1].index_copy_(0, slot.reshape(1), state[1].index_select(0, slot.reshape(1)) + 1)
        return ids.float()


def _args() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, 1000, (6,), generator=generator),
        torch.tensor(5),
        torch.tensor(2),
        torch.tensor([3, 7, 1, 9]),
        torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM),
        torch.randn(2, SLOTS, DIM, generator=generator),
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[ToyStep, Path, Path]:
    torch.manual_seed(0)
    model = ToyStep().eval()
    directory = tmp_path_factory.mktemp("toy")
    constants = compile_method(model, "step", _args(), directory / "step.pt2")
    assert set(constants) == {"embed.weight", "proj.weight", "scale"}
    save_file({k: v.contiguous() for k, v in constants.items()}, directory / "weights.safetensors")
    return model, directory / "step.pt2", directory / "weights.safetensors"


def test_weights_bound_at_load_and_caches_updated_in_place(compiled) -> None:
    model, package, weights = compiled
    assert package.stat().st_size < 16 * 1024 * 1024  # code only: about 2 MB whatever the weights
    graph = CompiledGraph(package, load_file(weights))
    eager_args = _args()
    compiled_args = tuple(a.clone() for a in eager_args)
    pointers = [a.data_ptr() for a in compiled_args]
    for _ in range(2):  # the second call sees the first call's writes
        want = model.step(*eager_args)
        got = graph(*compiled_args)
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_args[4], eager_args[4])
    torch.testing.assert_close(compiled_args[5], eager_args[5])
    assert [a.data_ptr() for a in compiled_args] == pointers


def test_weights_are_not_copied_into_the_runner(compiled) -> None:
    """user_managed binding: the graph reads our tensors, so changing them changes its output."""
    _, package, weights = compiled
    tensors = load_file(weights)
    graph = CompiledGraph(package, tensors)
    before = graph(*_args())
    tensors["proj.weight"].mul_(2)
    torch.testing.assert_close(graph(*_args()), 2 * before)


def test_missing_weights_are_refused_not_crashed(compiled) -> None:
    _, package, weights = compiled
    tensors = load_file(weights)
    del tensors["proj.weight"]
    with pytest.raises(KeyError, match=r"proj\.weight"):
        CompiledGraph(package, tensors)


def test_mutation_through_a_view_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CopyingMutationError, match="index_put_"):
        compile_method(ToyStep(), "step_through_views", _args(), tmp_path / "never.pt2")
    assert not (tmp_path / "never.pt2").exists()


@torch.library.custom_op("optimum_qwen36_test::scale_rows_", mutates_args=("table",))
def _scale_rows_(table: torch.Tensor, rows: torch.Tensor, factor: float) -> None:
    table[rows] *= factor


class CustomOpWriter(nn.Module):
    """Writes a state tensor through a mutating custom op: on the whole tensor, or on a view of it."""

    def whole(self, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        _scale_rows_(table, rows, 2.0)
        return rows + 1

    def view(self, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        _scale_rows_(table[1], rows, 2.0)
        return rows + 1


def test_a_custom_op_writing_a_whole_input_is_in_place_and_a_view_is_refused(tmp_path: Path) -> None:
    """As optimum_qwen36::gdn_decode_step writes the cache's states: accepted (Inductor re-inplaces it, the
    caller's tensor is written); the same op on a view of the input would be copied whole: refused."""
    rows = torch.tensor([0, 2])
    compile_method(CustomOpWriter(), "whole", (torch.ones(3, 4, 5), rows), tmp_path / "whole.pt2")
    graph = CompiledGraph(tmp_path / "whole.pt2", {})
    table = torch.ones(3, 4, 5)
    graph(table, rows)
    expected = torch.ones(3, 4, 5)
    expected[rows] *= 2.0
    assert torch.equal(table, expected)
    with pytest.raises(CopyingMutationError, match=r"input 0|table"):
        compile_method(CustomOpWriter(), "view", (torch.ones(3, 4, 5), rows), tmp_path / "view.pt2")


class SlowStep(nn.Module):
    """22 GFLOP of matrix products: a third of a second on one core here, long enough to see who else runs
    meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(768, 768) / 768**0.5)

    def step(self, x):
        for _ in range(24):
            x = torch.tanh(x @ self.weight)
        return x


def test_a_graph_runs_with_the_gil_released(tmp_path: Path) -> None:
    """Another Python thread runs while a graph does (a rank's gloo thread must, to finish collectives)."""
    model = SlowStep().eval()
    x = torch.randn(768, 768)
    constants = compile_method(model, "step", (x,), tmp_path / "slow.pt2")
    graph = CompiledGraph(tmp_path / "slow.pt2", constants)
    torch.testing.assert_close(graph(x), model.step(x))
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the call lasts long enough to count ticks on any machine
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.01)
        start = time.perf_counter()
        graph(x)
        end = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
        torch.set_num_threads(threads)
    during = [t for t in ticks if start < t < end]
    assert end - start > 0.05 and len(during) >= 5, (end - start, len(during))


def test_without_the_graph_runner_graphs_run_through_torchs_loader(
    compiled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the extension cannot be built, torch's loader runs the same graph (holding the GIL)."""
    from optimum_qwen36.backends import compiled_graph

    _, package, weights = compiled
    tensors = load_file(weights)
    expected = CompiledGraph(package, tensors)(*_args())
    monkeypatch.setattr(compiled_graph, "graph_runner_module", lambda: None)
    torch.testing.assert_close(CompiledGraph(package, tensors)(*_args()), expected, rtol=0, atol=0)


def test_an_extension_that_does_not_build_is_reported_with_its_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What every native extension does where it cannot be built: no exception, a warning that names the
    extension, the compiler's complaint and what runs instead."""
    from optimum_qwen36.ops.native import build_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    with caplog.at_level("WARNING"):
        built, module = build_extension(
            "The test kernels", "optimum_qwen36_broken_test", [source], [], python_module=True,
            fallback="the twin runs.",
        )  # fmt: skip
    assert (built, module) == (False, None)
    assert "The test kernels could not be built" in caplog.text
    assert caplog.text.rstrip().endswith("the twin runs.")
