"""Tensors in transparent huge pages: a decode step streams every weight (and every row's GDN state) once.
The cpu backend moves the model's weights there (`move_to_huge_pages`) and the cache allocates its tensors
there (`zeros`).

In 4 KB pages a stream crosses a page boundary every 64 cache lines: each page costs a TLB walk, and the
CPU's hardware prefetchers, which work within a page, start over; in 2 MB pages the native bf16 kernel
streams the projections faster (`benchmarks/bench_matvec.py --huge-pages`, docs/BENCHMARKS.md). Linux gives an
anonymous mapping huge pages where its `transparent_hugepage/enabled` is `always`, or `madvise` and the
mapping is advised MADV_HUGEPAGE (common defaults); `never` leaves everything as it is.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import nn

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGNMENT = 64  # bytes between the tensors placed in one mapping: a cache line, any dtype's alignment


def transparent_huge_pages() -> bool:
    """Whether this OS gives advised anonymous memory huge pages (Linux, THP not `never`)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes in a fresh anonymous mapping advised MADV_HUGEPAGE (zeros until written; the
    tensor keeps the mapping alive)."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`, in huge pages where the device is the CPU and the OS
    has transparent huge pages (a fresh mapping reads as zeros; its pages are committed as they are first
    written)."""
    if torch.device(device).type != "cpu" or not transparent_huge_pages():
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_bytes(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    )


def move_to_huge_pages(module: nn.Module) -> int:
    """Move `module`'s parameters and buffers (each CPU tensor that owns its whole storage, once per storage)
    into one mapping advised for huge pages, in place: parameters keep their objects, so tied weights stay
    tied and hold one copy. Tensor after tensor, so memory peaks at the moved bytes plus the largest tensor
    (where nothing else holds the originals). Returns the bytes moved: 0 where the OS has no transparent
    huge pages."""
    if not transparent_huge_pages():
        return 0
    # Where each tensor is referenced: (owner module, name, whether a parameter).
    references: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    originals: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for tensors, is_parameter in ((owner._parameters, True), (owner._buffers, False)):
            for name, tensor in tensors.items():
                if tensor is None or not tensor.numel() or not _owns_its_storage(tensor):
                    continue
                originals.setdefault(tensor.data_ptr(), tensor.detach())
                references.setdefault(tensor.data_ptr(), []).append((owner, name, is_parameter))
    offsets, total = {}, 0
    for ptr, tensor in originals.items():
        offsets[ptr] = total
        total += -(-tensor.nbytes // ALIGNMENT) * ALIGNMENT
    if not total:
        return 0
    memory = huge_page_bytes(total)
    for ptr in list(originals):
        tensor = originals.pop(ptr)
        copy = memory[offsets[ptr] : offsets[ptr] + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        del tensor
        for owner, name, is_parameter in references[ptr]:
            if is_parameter:
                owner._parameters[name].data = copy
            else:
                owner._buffers[name] = copy
    return total
