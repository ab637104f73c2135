"""A KV head's attention max-pooled over its GQA group, and its top-k tokens: Triton kernels.

Two launches:
  1. `_pooled_kernel`, grid (tiles, B, Hkv): program (t, b, m) loads the G queries of KV head m's
     group and their log-sum-exps once, then one tile of BLOCK_N keys, forms the (BLOCK_G,
     BLOCK_N) scores in one tl.dot, turns them into attention weights exp(s - lse) and keeps the
     largest over the group (App. B.1's max-pool): each key is read once for the whole group.
     Tokens past n_valid or not kept are written as -inf.
  2. `_topk_kernel`, grid (B, Hkv): holds a head's pooled row in one register tile (BLOCK_L =
     L_cap's bucket, kernels/launch.py, at most MAX_ROW tokens) and takes k_top rounds of "largest score,
     lowest token among equals", i.e. a stable descending sort cut at k_top, as the reference.
     A longer row is split into chunks of MAX_ROW tokens, each chunk's top k_top found alone, and
     the chunks' winners, put back in token order, compete again (`row_topk`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import empty
from .. import launch as configs
from .._triton import LOG2E
from .._triton import dot as _dot
from .reference import stable_topk


# lengths, and strides that follow them: no recompile as they grow (kernels/launch.py)
@triton.jit(do_not_specialize=["L_cap", "seb", "seh", "ssb", "ssh"])
def _pooled_kernel(
    q_ptr, k_ptr, lse_ptr, n_valid_ptr, keep_ptr, scores_ptr,
    qk_scale, L_cap,
    sqb, sqh, skb, skh, skl, slb, slh,  # q, k, lse strides
    seb, seh, ssb, ssh,  # keep and scores (B, Hkv, L_cap) strides
    GROUP: tl.constexpr, D: tl.constexpr, HAS_KEEP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)  # axis 0: up to 2**31 - 1 tiles (axes 1 and 2 stop at 65,535)
    b = tl.program_id(1).to(tl.int64)
    m = tl.program_id(2).to(tl.int64)
    n_valid = tl.minimum(tl.load(n_valid_ptr + b).to(tl.int32), L_cap)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    d_ok = d < D
    heads = m * GROUP + g
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(lse_ptr + b * slb + heads * slh, mask=g_ok, other=0.0) * 1.4426950408889634  # base 2
    cand = n < n_valid
    if HAS_KEEP:
        kept = tl.load(keep_ptr + b * seb + m * seh + n, mask=cand, other=0)
        cand = cand & (kept != 0)
    # other=0: slots past n_valid may hold garbage, maybe NaN
    k = tl.load(k_ptr + b * skb + m * skh + n[:, None].to(tl.int64) * skl + d[None, :],
                mask=cand[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
    s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale  # (BLOCK_G, BLOCK_N), base 2
    p = tl.exp2(s - lse2[:, None])  # each query head's attention weight
    p = tl.where(g_ok[:, None], p, float("-inf"))
    pooled = tl.max(p, axis=0)  # (BLOCK_N,)
    pooled = tl.where(cand, pooled, float("-inf"))
    tl.store(scores_ptr + b * ssb + m * ssh + n, pooled, mask=n < L_cap)


@triton.jit(do_not_specialize=["L_cap", "K", "ssb", "ssh", "sib", "sih"])
def _topk_kernel(scores_ptr, index_ptr, L_cap, K, ssb, ssh, sib, sih, BLOCK_L: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    n = tl.arange(0, BLOCK_L)
    work = tl.load(scores_ptr + b * ssb + m * ssh + n, mask=n < L_cap, other=float("-inf"))
    for j in range(K):
        best = tl.max(work, axis=0)
        pick = tl.min(tl.where((work == best) & (n < L_cap), n, BLOCK_L), axis=0)
        found = best > float("-inf")
        tl.store(index_ptr + b * sib + m * sih + j, tl.where(found, pick, -1).to(tl.int64))
        work = tl.where(n == pick, float("-inf"), work)


MAX_ROW = 32768  # the longest row one register tile of _topk_kernel holds


def row_topk(scores, k_top, max_row=MAX_ROW):
    """scores (B, H, L) float32 -> (B, H, k_top) int64: each row's stable descending top k_top
    (equal scores: the lower token first), -1 where the score is -inf. A row longer than max_row:
    the k_top best of a row are among the k_top best of each of its chunks, and with the chunks'
    winners kept in token order the lower token still wins a tie; the winners then compete as a
    shorter row (at most half as long when k_top <= max_row / 2)."""
    B, H, L = scores.shape
    if L <= max_row:
        index = torch.full((B, H, k_top), -7, dtype=torch.int64, device=scores.device)  # -7: never written
        cfg = configs.row_topk(L, configs.target(scores.device).arch)  # BLOCK_L: L's bucket
        _topk_kernel[(B, H)](scores, index, L, k_top, scores.stride(0), scores.stride(1),
                             index.stride(0), index.stride(1), **cfg.kwargs())
        return index
    if 2 * k_top > max_row:  # the chunks' winners would be no shorter than the row: sort it whole
        return stable_topk(scores, k_top)
    winners = []
    for a in range(0, L, max_row):
        local = row_topk(scores[:, :, a:a + max_row], k_top, max_row)  # (B, H, k_top), -1 pads
        winners.append(torch.where(local >= 0, local + a, -1))
    tokens = torch.cat(winners, dim=2)
    tokens = tokens.masked_fill(tokens < 0, L).sort(dim=2).values  # token order, pads (L) last
    cand = scores.gather(2, tokens.clamp_max(L - 1)).masked_fill(tokens == L, float("-inf"))
    pick = row_topk(cand.contiguous(), k_top, max_row)  # positions among the winners
    return torch.where(pick >= 0, tokens.gather(2, pick.clamp_min(0)), -1)


def attention_topk(q, k, lse, n_valid, keep, k_top, scale=None, max_row=MAX_ROW):
    assert q.dim() == 3 and k.dim() == 4, f"want q (B, Hq, D), k (B, Hkv, L, D); got {tuple(q.shape)}, {tuple(k.shape)}"
    B, Hq, D = q.shape
    _, Hkv, L_cap, _ = k.shape
    assert k.shape[0] == B and k.shape[3] == D and Hq % Hkv == 0, f"q {tuple(q.shape)}, k {tuple(k.shape)}"
    assert lse.shape == (B, Hq) and lse.dtype == torch.float32, f"lse must be (B, Hq) float32, got {tuple(lse.shape)}"
    assert n_valid.shape == (B,) and not n_valid.is_floating_point(), f"n_valid must be (B,) int, got {n_valid.shape}"
    assert keep is None or (keep.shape == (B, Hkv, L_cap) and keep.dtype == torch.bool and keep.stride(-1) == 1), \
        "keep must be None or (B, Hkv, L_cap) bool with contiguous rows"
    assert q.dtype == k.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"{q.dtype}, {k.dtype}"
    assert q.stride(-1) == k.stride(-1) == 1, "the head dim must be contiguous"
    assert q.device == k.device == lse.device == n_valid.device, "all tensors on one device"
    target = configs.target(q.device)
    configs.check_device(target, q)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    scores = empty((B, Hkv, L_cap), torch.float32, q.device)
    G = Hq // Hkv
    cfg = configs.attention_topk_pooled(G, D, q.dtype, target.arch)
    keep_arg = keep.view(torch.uint8) if keep is not None else scores  # any pointer when unused
    _pooled_kernel[(triton.cdiv(L_cap, cfg.blocks["BLOCK_N"]), B, Hkv)](
        q, k, lse, n_valid, keep_arg, scores,
        scale * LOG2E, L_cap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), lse.stride(0), lse.stride(1),
        keep.stride(0) if keep is not None else 0, keep.stride(1) if keep is not None else 0,
        scores.stride(0), scores.stride(1),
        GROUP=G, D=D, HAS_KEEP=keep is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=target.interpreted and q.dtype == torch.bfloat16,
        **cfg.kwargs(),
    )
    return scores, row_topk(scores, k_top, max_row)
