"""Decode attention over a gathered cache (per KV head a list of slots), Triton kernels.

Two launches (flash-decoding, as kernels/decode_attention):
  1. `_partial_kernel`, grid (B, Hkv, S): program (b, m, s) takes the list entries of KV head m
     of row b that fall in split s, [s * split_len, (s + 1) * split_len). Per tile of BLOCK_N
     entries it loads the slot numbers, then those K rows (a gather straight from the store:
     nothing is copied first), and attends with all the query heads of the group at once, online
     softmax; entries of -1 are masked and their loads skipped. An empty split writes lse = -inf.
  2. `merge_splits` (kernels/_triton.py), grid (B, Hq): merges the partials by their lse.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import empty
from .. import launch as configs
from .._triton import LN2, LOG2E, check_dense_kv, merge_splits, split_len_for
from .._triton import dot as _dot


# lengths, and strides that follow them or the split count: no recompile as they change (kernels/launch.py)
@triton.jit(do_not_specialize=["N", "split_len", "sib", "sih", "slb", "slh"])
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, lse_ptr,
    qk_scale, N, split_len,
    sqb, sqh, skb, skh, skl, svb, svh, svl,  # q, k, v strides (last dim contiguous)
    sib, sih,  # index (B, Hkv, N) strides (entry dim contiguous)
    sob, soh, sos, slb, slh,  # partial out (B, Hq, S, D) and lse (B, Hq, S) strides
    GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    start = split * split_len
    end = tl.minimum(start + split_len, N)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    heads = m * GROUP + g
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :], mask=q_mask, other=0.0)  # (BLOCK_G, BLOCK_D)

    k_base = k_ptr + b * skb + m * skh
    v_base = v_ptr + b * svb + m * svh
    mx = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of base-2 scores
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_ptr + b * sib + m * sih + n, mask=n < end, other=-1).to(tl.int64)  # (BLOCK_N,)
        listed = slot >= 0
        kv_mask = listed[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * skl + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale  # (BLOCK_G, BLOCK_N)
        s = tl.where(listed[None, :], s, float("-inf"))
        m_new = tl.maximum(mx, tl.max(s, axis=1))
        # a tile of -1 entries before any listed one leaves m_new = -inf: subtract 0 instead
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(mx - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slot[:, None] * svl + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        mx = m_new

    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (mx + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(o_ptr + b * sob + heads[:, None] * soh + split * sos + d[None, :], out, mask=q_mask)
    tl.store(lse_ptr + b * slb + heads * slh + split, lse, mask=g < GROUP)


def default_split_len(B: int, Hkv: int, N: int, target: configs.Target, block_n: int) -> int:
    """Entries per program (`split_len_for`, as decode_attention); >= block_n, so that an empty
    list (N = 0) still makes one split, which writes lse = -inf."""
    if target.interpreted:
        return max(N, block_n)
    return split_len_for(B * Hkv, target.n_sm, max(N, 1), block_n)


def launch(q, k, v, index, scale=None, return_lse=False, split_len=None, block_n=None):
    """gathered_attention with the launch parameters exposed (tests use them to force splits;
    block_n None: the launch configuration's, kernels/launch.py)."""
    B, Hq, Hkv, D = check_dense_kv(q, k, v, index, block_n=block_n)
    target = configs.target(q.device)
    cfg = configs.gathered_attention(Hq // Hkv, D, q.dtype, target.arch)
    if block_n is not None:
        cfg = configs.Config({**cfg.blocks, "BLOCK_N": block_n}, cfg.num_warps, cfg.num_stages)
    block_n = cfg.blocks["BLOCK_N"]
    assert index.dim() == 3 and index.shape[:2] == (B, Hkv) and not index.is_floating_point(), \
        f"index must be (B={B}, Hkv={Hkv}, N) int, got {tuple(index.shape)} {index.dtype}"
    assert index.stride(-1) == 1, "index rows must be contiguous"

    N = index.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    split_len = split_len or default_split_len(B, Hkv, N, target, block_n)
    S = max(1, triton.cdiv(N, split_len))
    o_part = empty((B, Hq, S, D), torch.float32, q.device)
    lse_part = empty((B, Hq, S), torch.float32, q.device)
    group = Hq // Hkv
    _partial_kernel[(B, Hkv, S)](
        q, k, v, index, o_part, lse_part,
        scale * LOG2E, N, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        index.stride(0), index.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        GROUP=group, D=D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=target.interpreted and q.dtype == torch.bfloat16,
        **cfg.kwargs(),
    )
    out = empty((B, Hq, D), q.dtype, q.device)
    lse = empty((B, Hq), torch.float32, q.device)
    merge_splits(o_part, lse_part, out, lse)
    return (out, lse) if return_lse else out


def gathered_attention(q, k, v, index, scale=None, return_lse=False):
    return launch(q, k, v, index, scale, return_lse)
