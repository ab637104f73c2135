"""Decode attention over the active tokens fused with the relevance of Eq. 2, Triton kernels.

Two launches (flash-decoding):
  1. `_partial_kernel`, grid (B, S): program (b, s) owns the slots of row b in split s,
     [s * split_len, (s + 1) * split_len), for *all* query heads at once. For each tile of
     BLOCK_N slots it loads K of every KV head once and forms the raw dot products of every query
     head with the key of its group, q_h . k_j^(h) (a (BLOCK_H, BLOCK_N) tile: one masked tl.dot
     per KV head, since heads of other groups must not mix). From that one tile come
       - the relevance s_j = 1/Hq sum_h |q_h . k_j^(h)| of every slot in the tile, complete (all
         heads are in this program), written once: no atomics, no second reduction, deterministic;
       - the softmax scores (times scale), folded into an online softmax and P.V as usual.
     So K is read once for both results, which is the point of fusing: computed apart, relevance
     would be a second full pass over the active cache every step, in every layer. The program
     also writes s = 0 on its slots past the row's length, so s needs no separate zero fill.
     With GQA the masked per-group dot costs Hkv times the FLOPs of a grouped one; decode is
     bound by reading the cache, not by FLOPs, and each K/V row is still read exactly once.
  2. `merge_splits` (kernels/_triton.py), grid (B, Hq): merges the S partial outputs by their
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
@triton.jit(do_not_specialize=["L_cap", "split_len", "slb", "slh", "ssb"])
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, o_ptr, lse_ptr, s_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    inv_hq,  # 1 / Hq: Eq. 2 is a mean over query heads
    L_cap, split_len,
    sqb, sqh, skb, skh, skl, svb, svh, svl,  # q, k, v strides (last dim contiguous)
    sob, soh, sos, slb, slh, ssb,  # partial out (B, Hq, S, D), lse (B, Hq, S), s (B, L_cap) strides
    HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    length = tl.minimum(tl.load(lengths_ptr + b).to(tl.int32), L_cap)
    start = split * split_len
    stop = tl.minimum(start + split_len, L_cap)  # this program's slots, valid or not
    end = tl.minimum(stop, length)  # ... and the valid ones

    h = tl.arange(0, BLOCK_H).to(tl.int64)  # all query heads (int64: h * sqh may pass 2**31), padded to >= 16 rows for tl.dot
    d = tl.arange(0, BLOCK_D)
    h_ok = h < HQ
    d_ok = d < D
    group_of = h // GROUP  # the KV head each query head reads
    q_mask = h_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + d[None, :], mask=q_mask, other=0.0)  # (BLOCK_H, BLOCK_D)

    k_base = k_ptr + b * skb
    v_base = v_ptr + b * svb
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the base-2 scores
    l = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp2(score - m) * v
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        raw = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)  # q_h . k_j^(h), unscaled
        for j in range(HKV):  # a loop, not unrolled: one KV head's tile live at a time
            # other=0: slots past the length hold garbage, maybe NaN, and 0 * NaN is NaN
            kj = tl.load(k_base + j * skh + n[:, None].to(tl.int64) * skl + d[None, :], mask=kv_mask, other=0.0)
            raw += tl.where((group_of == j)[:, None], _dot(q, tl.trans(kj), DOT_PRECISION, UPCAST_DOT), 0.0)
        # Eq. 2 for the slots of this tile: every query head is here, so s_j is final
        rel = tl.sum(tl.where(h_ok[:, None], tl.abs(raw), 0.0), axis=0) * inv_hq  # (BLOCK_N,)
        tl.store(s_ptr + b * ssb + n, rel, mask=n_ok)

        scores = tl.where(n_ok[None, :], raw * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every tile holds >= 1 valid slot
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max; 0 on the first tile
        p = tl.exp2(scores - m_new[:, None])  # (BLOCK_H, BLOCK_N)
        l = l * alpha + tl.sum(p, axis=1)
        pv = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for j in range(HKV):  # a loop, not unrolled: one KV head's tile live at a time
            vj = tl.load(v_base + j * svh + n[:, None].to(tl.int64) * svl + d[None, :], mask=kv_mask, other=0.0)
            # p rounded to the cache dtype for the tensor cores, as flash attention does
            pv += tl.where((group_of == j)[:, None], _dot(p.to(vj.dtype), vj, DOT_PRECISION, UPCAST_DOT), 0.0)
        acc = acc * alpha[:, None] + pv
        m = m_new

    # s = 0 on this program's slots past the row's length (the contract of the reference)
    for n0 in range(tl.maximum(end, start), stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        tl.store(s_ptr + b * ssb + n, tl.zeros([BLOCK_N], tl.float32), mask=n < stop)

    # an empty split (past the row's length) leaves l = 0: out 0, lse -inf, weight 0 in the combine
    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m + tl.log2(l_safe)) * LN2, float("-inf"))  # back to natural log
    tl.store(o_ptr + b * sob + h[:, None] * soh + split * sos + d[None, :], out, mask=q_mask)
    tl.store(lse_ptr + b * slb + h * slh + split, lse, mask=h_ok)


def default_split_len(B: int, L_cap: int, target: configs.Target, block_n: int) -> int:
    """Slots per program (`split_len_for`: at most MAX_SPLITS splits, as decode_attention)."""
    if target.interpreted:
        return max(L_cap, 1)  # one split: interpreted programs cost time, parallelism buys nothing
    return split_len_for(B, target.n_sm, L_cap, block_n)


def launch(q, k, v, lengths, scale=None, split_len=None, block_n=None):
    """attention_relevance with the launch parameters exposed (tests use them to force splits;
    block_n None: the launch configuration's, kernels/launch.py)."""
    B, Hq, Hkv, D = check_dense_kv(q, k, v, lengths, block_n=block_n)
    L_cap = k.shape[2]
    target = configs.target(q.device)
    cfg = configs.attention_relevance(Hq, Hkv, D, q.dtype, target.arch)
    if block_n is not None:
        cfg = configs.Config({**cfg.blocks, "BLOCK_N": block_n}, cfg.num_warps, cfg.num_stages)
    block_n = cfg.blocks["BLOCK_N"]
    assert lengths.shape == (B,) and not lengths.is_floating_point(), f"lengths must be (B,) int, got {lengths.shape}"

    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    split_len = split_len or default_split_len(B, L_cap, target, block_n)
    S = triton.cdiv(L_cap, split_len)
    o_part = empty((B, Hq, S, D), torch.float32, q.device)  # NaN under the interpreter: see empty
    lse_part = empty((B, Hq, S), torch.float32, q.device)
    s = empty((B, L_cap), torch.float32, q.device)
    _partial_kernel[(B, S)](
        q, k, v, lengths, o_part, lse_part, s,
        scale * LOG2E, 1.0 / Hq, L_cap, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1), s.stride(0),
        HQ=Hq, HKV=Hkv, GROUP=Hq // Hkv, D=D,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 would cost ~1e-3 on float32
        UPCAST_DOT=target.interpreted and q.dtype == torch.bfloat16,
        **cfg.kwargs(),
    )
    out = torch.empty_like(q)
    merge_splits(o_part, lse_part, out, torch.empty(B, Hq, dtype=torch.float32, device=q.device))
    return out, s


def attention_relevance(q, k, v, lengths, scale=None):
    return launch(q, k, v, lengths, scale)
