"""Decode attention over a contiguous KV cache, Triton kernels (flash-decoding).

Two launches:
  1. `_partial_kernel`, grid (B, Hkv, S): program (b, j, s) takes the slots of row b that fall in
     split s, [s * split_len, (s + 1) * split_len), and attends to them with *all* the query heads
     of KV group j at once, tiling the slots by BLOCK_N with an online softmax. Every K/V row is
     read once per group instead of once per query head: with GQA that is the memory-traffic win
     (3x for SmolLM2's 9 query heads over 3 KV heads). Splitting the slots gives a GPU enough
     programs when B * Hkv alone is far below its SM count (one sequence, 3 KV heads).
  2. `merge_splits` (kernels/_triton.py), grid (B, Hq): merges the S partial results by their
     log-sum-exps.
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
@triton.jit(do_not_specialize=["window", "L_cap", "split_len", "slb", "slh"])
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, o_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2, exp2 being the fast one
    window, L_cap, split_len,
    sqb, sqh, skb, skh, skl, svb, svh, svl,  # q, k, v strides (last dim contiguous)
    sob, soh, sos, slb, slh,  # partial out (B, Hq, S, D) and lse (B, Hq, S) strides
    GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 caches: tf32 would cost ~1e-3 accuracy
    UPCAST_DOT: tl.constexpr,  # bfloat16 under the interpreter, see _dot
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.minimum(tl.load(lengths_ptr + b).to(tl.int32), L_cap)
    start = tl.maximum(split * split_len, tl.maximum(length - window, 0))
    end = tl.minimum((split + 1) * split_len, length)

    g = tl.arange(0, BLOCK_G)  # query heads of this group, padded to >= 16 rows for tl.dot
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    heads = kvh.to(tl.int64) * GROUP + g  # int64: heads * sqh passes 2**31 in a long batch
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :], mask=q_mask, other=0.0)  # (BLOCK_G, BLOCK_D)

    k_base = k_ptr + b * skb + kvh.to(tl.int64) * skh
    v_base = v_ptr + b * svb + kvh.to(tl.int64) * svh
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the base-2 scores
    l = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of exp2(score - m) * v
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        # other=0: slots past the length hold garbage, maybe NaN, and 0 * NaN is NaN
        k = tl.load(k_base + n[:, None].to(tl.int64) * skl + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale  # (BLOCK_G, BLOCK_N)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds >= 1 valid slot
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max; 0 on the first tile
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None].to(tl.int64) * svl + d[None, :], mask=kv_mask, other=0.0)
        # p is rounded to the cache dtype for the tensor cores, as flash attention does
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m = m_new

    # An empty split (past the row's length, or before its window) leaves l = 0: it writes
    # out = 0 and lse = -inf, which gives it weight 0 in the combine.
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m + tl.log2(l_safe)) * LN2, float("-inf"))  # back to natural log
    o_rows = o_ptr + b * sob + heads[:, None] * soh + split * sos
    tl.store(o_rows + d[None, :], out, mask=q_mask)
    tl.store(lse_ptr + b * slb + heads * slh + split, lse, mask=g < GROUP)


def default_split_len(B: int, Hkv: int, L_cap: int, target: configs.Target, block_n: int) -> int:
    """Slots per program (`split_len_for`: ~2 programs per SM, at most MAX_SPLITS splits)."""
    if target.interpreted:
        return max(L_cap, 1)  # one split: interpreted programs cost time, parallelism buys nothing
    return split_len_for(B * Hkv, target.n_sm, L_cap, block_n)


def launch(q, k, v, lengths, scale=None, window=None, return_lse=False, split_len=None, block_n=None):
    """decode_attention with the launch parameters exposed (tests use them to force splits; block_n
    None: the launch configuration's, kernels/launch.py)."""
    B, Hq, Hkv, D = check_dense_kv(q, k, v, lengths, block_n=block_n)
    L_cap = k.shape[2]
    target = configs.target(q.device)
    cfg = configs.decode_attention(Hq // Hkv, D, q.dtype, target.arch)
    if block_n is not None:
        cfg = configs.Config({**cfg.blocks, "BLOCK_N": block_n}, cfg.num_warps, cfg.num_stages)
    block_n = cfg.blocks["BLOCK_N"]
    assert lengths.shape == (B,) and not lengths.is_floating_point(), f"lengths must be (B,) int, got {lengths.shape}"

    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    split_len = split_len or default_split_len(B, Hkv, L_cap, target, block_n)
    S = triton.cdiv(L_cap, split_len)
    o_part = empty((B, Hq, S, D), torch.float32, q.device)  # partial results of each split
    lse_part = empty((B, Hq, S), torch.float32, q.device)
    group = Hq // Hkv
    _partial_kernel[(B, Hkv, S)](
        q, k, v, lengths, o_part, lse_part,
        scale * LOG2E, window if window is not None else L_cap, L_cap, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        GROUP=group, D=D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32: the default, ignored for 16-bit
        UPCAST_DOT=target.interpreted and q.dtype == torch.bfloat16,
        **cfg.kwargs(),
    )
    out = empty((B, Hq, D), q.dtype, q.device)
    lse = empty((B, Hq), torch.float32, q.device)
    merge_splits(o_part, lse_part, out, lse)
    return (out, lse) if return_lse else out


def decode_attention(q, k, v, lengths, scale=None, window=None, return_lse=False):
    return launch(q, k, v, lengths, scale, window, return_lse)
