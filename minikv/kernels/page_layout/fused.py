"""HND -> NHD page scatter, Triton kernel. Grid (n,): program i reads block i (2, P, D), which is
contiguous, and writes its P key rows and P value rows to slot slots[i], KV head heads[i] of the
pool, rows Hkv * D elements apart. One program per block keeps every read contiguous; on a GPU the
blocks of one recall are independent, so they run in parallel.

Memory traffic: each block is read once and written once as P strided rows of D elements; the
reference's advanced-index assignment does the same with a temporary index tensor per call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import launch as configs


@triton.jit
def _hnd_to_nhd_kernel(
    blk_ptr, k_ptr, v_ptr, slots_ptr, heads_ptr,
    sbn, sbkv, sbp, sks, skp, skh, svs, svp, svh,
    P: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    head = tl.load(heads_ptr + i).to(tl.int64)
    t = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    mask = (t < P)[:, None] & (d < D)[None, :]
    src = blk_ptr + i * sbn + t[:, None] * sbp + d[None, :]
    keys = tl.load(src, mask=mask)
    vals = tl.load(src + sbkv, mask=mask)
    tl.store(k_ptr + slot * sks + t[:, None] * skp + head * skh + d[None, :], keys.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + slot * svs + t[:, None] * svp + head * svh + d[None, :], vals.to(v_ptr.dtype.element_ty), mask=mask)


def hnd_to_nhd(blocks, k_pages, v_pages, slots, heads):
    assert blocks.dim() == 4 and blocks.shape[1] == 2, f"blocks (n, 2, P, D), got {tuple(blocks.shape)}"
    n, _, P, D = blocks.shape
    assert k_pages.shape == v_pages.shape and k_pages.dim() == 4 and k_pages.shape[1] == P and k_pages.shape[3] == D, \
        f"pool (S, P={P}, Hkv, D={D}), got k {tuple(k_pages.shape)}, v {tuple(v_pages.shape)}"
    assert slots.shape == (n,) and heads.shape == (n,), f"slots, heads (n={n},), got {tuple(slots.shape)}, {tuple(heads.shape)}"
    assert not slots.is_floating_point() and not heads.is_floating_point()
    # the kernel reads slots[i] at slots_ptr + i: a strided view would send blocks to wrong slots
    assert slots.is_contiguous() and heads.is_contiguous(), "slots and heads must be contiguous"

    assert blocks.stride(-1) == k_pages.stride(-1) == v_pages.stride(-1) == 1, "the head dim must be contiguous"
    assert blocks.device == k_pages.device == v_pages.device == slots.device == heads.device, "one device"
    target = configs.target(blocks.device)
    configs.check_device(target, blocks)
    if n == 0:
        return
    _hnd_to_nhd_kernel[(n,)](
        blocks, k_pages, v_pages, slots, heads,
        blocks.stride(0), blocks.stride(1), blocks.stride(2),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        P=P, D=D, **configs.page_layout(P, D, target.arch).kwargs(),
    )
