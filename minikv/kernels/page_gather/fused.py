"""Gathered page recall, Triton kernel. Grid (n, cdiv(E, BLOCK)): program (i, j) copies the j-th
BLOCK elements of block rows[i] of src (E contiguous elements per block) to out[i]: every read
and write contiguous, the blocks of one recall in parallel.

Memory traffic: one read of each selected block, one contiguous write; index_select does exactly
this on the CPU.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from .. import launch as configs


@triton.jit
def _gather_kernel(src_ptr, rows_ptr, out_ptr, E, s_src, s_out, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    e = j * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + row * s_src + e, mask=e < E)
    tl.store(out_ptr + i * s_out + e, x, mask=e < E)


def _blocks_contiguous(t):
    # the elements of one block are E consecutive elements (any stride between blocks)
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def page_gather(src, rows, out):
    n = rows.numel()
    assert rows.dim() == 1 and not rows.is_floating_point() and rows.is_contiguous(), "rows: (n,) contiguous ints"
    assert src.shape[1:] == out.shape[1:] and out.shape[0] >= n, f"src {tuple(src.shape)}, out {tuple(out.shape)}, n={n}"
    assert src.dtype == out.dtype, f"src {src.dtype}, out {out.dtype}"
    E = math.prod(src.shape[1:])
    # a block must be E contiguous elements (one page of one head, keys then values)
    assert _blocks_contiguous(src) and _blocks_contiguous(out), "each block must be contiguous"
    assert src.device == rows.device == out.device, "one device"
    target = configs.target(src.device)
    configs.check_device(target, src)
    if n:
        cfg = configs.copy_block(E, target.arch)
        grid = (n, triton.cdiv(E, cfg.blocks["BLOCK"]))  # E is one page of one head: axis 1 stays small
        _gather_kernel[grid](src, rows, out, E, src.stride(0), out.stride(0), **cfg.kwargs())
    return out[:n]
