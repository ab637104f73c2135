"""Decode attention over a paged NHD cache through a per-KV-head page table, Triton kernel.

Grid (B, Hkv): program (b, m) walks the N entries of its page table row with an online softmax,
attending with all G query heads of the group at once (each page of K and V is read once per
group, not once per query head). An entry's slot and length are loaded as scalars; tokens past the
length (the partly filled last page) and entries of length 0 are masked, and the masked lanes'
loads are skipped (other=0), so garbage in the pool is never read into the sums.

Memory traffic: reference.py's gather copies every listed page (N * P * D per KV head, twice) before any
arithmetic, and the masked softmax materialises scores over N * P. The kernel reads each listed
page straight from the pool once for the whole GQA group, and skips the masked tail of a page.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import empty
from .. import launch as configs
from .._triton import LN2, LOG2E
from .._triton import dot as _dot

# table lengths, and strides that follow them: no recompile as they grow (kernels/launch.py)
@triton.jit(do_not_specialize=["N", "stb", "sth", "slb", "slh"])
def _paged_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, o_ptr, lse_ptr,
    qk_scale, N,
    sqb, sqh, sks, skp, skh, svs, svp, svh,  # q and pool strides (last dim contiguous)
    stb, sth, slb, slh, sob, soh,  # table, lens, out strides (entry dim contiguous)
    GROUP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    heads = m * GROUP + g
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :], mask=q_mask, other=0.0)  # (BLOCK_G, BLOCK_D)

    mx = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of base-2 scores
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j in range(N):
        slot = tl.load(table_ptr + b * stb + m * sth + j).to(tl.int64)
        length = tl.load(lens_ptr + b * slb + m * slh + j)
        t_ok = (t < length) & (t < P)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot * sks + t[:, None] * skp + m * skh + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_P, BLOCK_D)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale  # (BLOCK_G, BLOCK_P)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(mx, tl.max(s, axis=1))
        # an unused entry (length 0) before any valid one leaves m_new = -inf: subtract 0 instead,
        # so that exp2(-inf - -inf) never makes a NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(mx - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot * svs + t[:, None] * svp + m * svh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        mx = m_new

    out = acc / l[:, None]  # l > 0: every (b, m) lists at least one token
    lse = (mx + tl.log2(l)) * LN2
    tl.store(o_ptr + b * sob + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + b * (GROUP * tl.num_programs(1)) + heads, lse, mask=g < GROUP)


def paged_attention(q, k_pages, v_pages, page_table, page_lens, scale=None, return_lse=False):
    assert q.dim() == 3 and k_pages.dim() == 4, f"q (B, Hq, D), pool (S, P, Hkv, D); got {tuple(q.shape)}, {tuple(k_pages.shape)}"
    B, Hq, D = q.shape
    S, P, Hkv, _ = k_pages.shape
    assert v_pages.shape == k_pages.shape and k_pages.shape[3] == D, f"k {tuple(k_pages.shape)}, v {tuple(v_pages.shape)}"
    assert Hq % Hkv == 0, f"query heads {Hq} must be a multiple of KV heads {Hkv}"
    assert page_table.shape == page_lens.shape and page_table.shape[:2] == (B, Hkv), \
        f"page_table {tuple(page_table.shape)}, page_lens {tuple(page_lens.shape)}, expected (B={B}, Hkv={Hkv}, N)"
    assert not page_table.is_floating_point() and not page_lens.is_floating_point(), "table and lens are ints"
    assert page_table.stride(-1) == 1 and page_lens.stride(-1) == 1, "table rows must be contiguous"
    assert q.dtype == k_pages.dtype == v_pages.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert q.stride(-1) == k_pages.stride(-1) == v_pages.stride(-1) == 1, "the head dim must be contiguous"
    assert q.device == k_pages.device == v_pages.device == page_table.device == page_lens.device, "one device"
    target = configs.target(q.device)
    configs.check_device(target, q)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = empty(q.shape, q.dtype, q.device)  # NaN under the interpreter: see empty
    lse = empty((B, Hq), torch.float32, q.device)
    G = Hq // Hkv
    cfg = configs.paged_attention(G, P, D, q.dtype, target.arch)
    _paged_kernel[(B, Hkv)](
        q, k_pages, v_pages, page_table, page_lens, out, lse,
        scale * LOG2E, page_table.shape[2],
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        page_table.stride(0), page_table.stride(1), page_lens.stride(0), page_lens.stride(1),
        out.stride(0), out.stride(1),
        GROUP=G, D=D, P=P,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=target.interpreted and q.dtype == torch.bfloat16,
        **cfg.kwargs(),
    )
    return (out, lse) if return_lse else out
