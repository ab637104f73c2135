"""CPU memory in transparent huge pages, for what a decode step streams: the model's weights.

A decode step reads ~540 MB of weights. With 4 KB pages that is ~130,000 pages a step, far more
than the TLB covers, and a one-row product's reads stall on page walks; with 2 MB pages, ~270.
Linux gives huge pages to anonymous private memory advised with MADV_HUGEPAGE (the default
`madvise` setting of /sys/kernel/mm/transparent_hugepage/enabled); PyTorch's allocator advises
only when THP_MEM_ALLOC_ENABLE=1 is set before torch starts. Measured on a 2-core EPYC, one
thread: a large sum reads 33 GB/s from huge pages against 22-29 from the allocator's memory; the
compiled decode step at two threads takes 18 ms against 26 (docs/speed.md). minikv.fast moves a
loaded model's weights here (`move_parameters`); `empty` serves buffers such as the bandwidth
probe's. Where the kernel has no transparent huge pages, or the platform no madvise, the memory
is ordinary pages.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 * 2**20  # x86-64's transparent huge page


def arena(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory (uint8), starting on a huge-page boundary, in a private anonymous
    mapping advised for huge pages. The tensor holds the mapping: it lives as long as any view."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)  # shared memory gets no THP
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, **({"flags": flags} if flags else {}))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled in this kernel: ordinary pages
            pass
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps a reference to buf
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _span(shape, strides, itemsize: int) -> int:
    # bytes from a tensor's first element to its last, in these strides
    return (1 + sum((n - 1) * st for n, st in zip(shape, strides))) * itemsize if math.prod(shape) else 0


def move_parameters(module: torch.nn.Module, column_major=lambda p: False) -> None:
    """Every CPU parameter of module (a tied one once) into one arena, in place (`p.data`: same
    values and shapes; the same strides, or column-major where column_major(p) says so), laid
    out in order, each 64-byte aligned, the first on a huge page; each original is freed as soon
    as it is copied (unless held elsewhere), so the weights are held twice one tensor at a time."""
    params = [p for p in module.parameters() if p.device.type == "cpu"]
    strides = [(1, p.shape[0]) if p.dim() == 2 and column_major(p) else p.stride() for p in params]
    sizes = [-(-_span(p.shape, st, p.element_size()) // 64) * 64 for p, st in zip(params, strides)]
    memory, offset = arena(sum(sizes)), 0
    for p, st, size in zip(params, strides, sizes):
        region = memory[offset:offset + size].view(p.dtype)
        p.data = region.as_strided(p.shape, st, region.storage_offset()).copy_(p.data)
        offset += size


def empty(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device), in huge pages where that can help: on the
    CPU and at least one huge page large (then zeroed, as a fresh mapping is; elsewhere
    uninitialised, as torch.empty's)."""
    device = torch.device(device)
    if device.type != "cpu" or math.prod(shape) * dtype.itemsize < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    return arena(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
