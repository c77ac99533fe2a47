"""Weights and cache tensors in transparent huge pages (`ops.huge_pages`): the same values, tied weights still
tied, and the memory really advised MADV_HUGEPAGE (the kernel's own record of the mapping, /proc/self/smaps);
nothing moves where the OS has no transparent huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from optimum_qwen36.ops import huge_pages
from optimum_qwen36.ops.huge_pages import move_to_huge_pages, transparent_huge_pages, zeros

SMAPS = Path("/proc/self/smaps")


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` carries the MADV_HUGEPAGE flag ('hg') in /proc/self/smaps."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


needs_huge_pages = pytest.mark.skipif(
    not (transparent_huge_pages() and SMAPS.is_file()), reason="no transparent huge pages here"
)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(64)
        self.register_buffer("table", torch.randn(40, 64))
        self.register_buffer("view", self.table[3:5], persistent=False)  # does not own its storage


@needs_huge_pages
def test_moved_tensors_keep_their_values_and_ties_in_advised_memory() -> None:
    torch.manual_seed(0)
    module = Tied().to(torch.bfloat16)
    module.view = module.table[3:5]  # .to() copied it
    before = {name: t.clone() for name, t in module.state_dict(keep_vars=True).items()}
    view_address = module.view.data_ptr()
    moved = move_to_huge_pages(module)
    assert moved >= sum(t.nbytes for name, t in before.items() if name not in ("head.weight", "view"))
    assert module.head.weight is module.embed.weight  # one Parameter object, one copy
    for name, tensor in module.state_dict(keep_vars=True).items():
        assert torch.equal(tensor, before[name]), name
    assert module.view.data_ptr() == view_address  # a view is left where it is
    for tensor in (module.embed.weight, module.norm.bias, module.table):
        assert advised_for_huge_pages(tensor.data_ptr())
    # The flag tells advised memory apart: a fresh mapping nobody advised lacks it. (The originals' heap is
    # no control: malloc or a library may advise it, as one CI worker's was.)
    plain = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert not advised_for_huge_pages(torch.frombuffer(plain, dtype=torch.uint8).data_ptr())
    out = module.head(module.norm(module.embed(torch.tensor([[1, 2]]))))  # still an ordinary module
    assert out.shape == (1, 2, 300)


@needs_huge_pages
def test_cache_tensors_are_writable_zeros_in_advised_memory() -> None:
    state = zeros((3, 5, 7), torch.float32)
    assert state.shape == (3, 5, 7) and state.dtype == torch.float32 and not state.any()
    state[1, 2] = 4.0
    assert state.sum() == 28.0
    assert advised_for_huge_pages(state.data_ptr())


def test_nothing_moves_without_transparent_huge_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    module = Tied()
    address = module.embed.weight.data_ptr()
    assert move_to_huge_pages(module) == 0
    assert module.embed.weight.data_ptr() == address
    assert not zeros((2, 3), torch.float32).any()
