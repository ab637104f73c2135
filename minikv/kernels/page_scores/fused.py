"""Page scores, group reduction and top-k per KV head in one Triton kernel.

Grid (B, Hkv): program (b, m) owns KV head m of row b and every query head of its group. It holds
all N candidate pages of the head in one register tile (BLOCK_N = N's bucket in kernels/launch.py:
64, 256, 1,024, 4,096 or 16,384 pages), so the softmax over pages, the mean over the
group and the top-k never leave registers:

  1. raw (BLOCK_G, BLOCK_N): sum over channels of max(q_d lo_d, q_d hi_d), one channel column at a
     time (the digests are read once for the whole group, not once per query head); with codes,
     the approximate page mass instead: token t of every page at once, q . k^_t accumulated one
     channel at a time, then folded into a running logsumexp over t (no (P, N) tile);
  2. the group reduction (softmax-mean, mean or max) to one score per page;
  3. k rounds of arg-max with ties to the lowest page index, each taking its page out of the tile.

Memory traffic: reference.py reads the digests in two matmuls (q+ against hi, q- against lo; see
the code) and materialises the per-head scores and softmax; the kernel reads each digest row
once per KV head for the whole group and keeps scores in registers through the reduction and
the top-k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import empty
from .. import launch as configs

REDUCE_CODES = {"softmax_mean": 0, "mean": 1, "max": 2}


# counts, and strides that follow them: no recompile as they grow (kernels/launch.py)
@triton.jit(do_not_specialize=["N", "K", "ssb", "ssh", "sib", "sih"])
def _page_scores_kernel(
    q_ptr, lo_ptr, hi_ptr, n_valid_ptr, scores_ptr, index_ptr, codes_ptr,
    scale, N, K,
    sqb, sqh, sqd, slb, slh, sln, shb, shh, shn,  # q, lo, hi strides (digest channel dim contiguous)
    ssb, ssh, sib, sih,  # scores (B, Hkv, N) and index (B, Hkv, K) strides
    scb, sch, scn, sct,  # codes (B, Hkv, N, P, ceil(D / 4)) strides (byte dim contiguous)
    GROUP: tl.constexpr, D: tl.constexpr, REDUCE: tl.constexpr, HAS_CODES: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    n_valid = tl.minimum(tl.load(n_valid_ptr + b).to(tl.int32), N)
    g = tl.arange(0, BLOCK_G)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    n_ok = n < n_valid
    heads = m * GROUP + g

    raw = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    if HAS_CODES:  # P_h[n] = log sum_t exp(scale q . k^_t) / scale, k^ = lo + c (hi - lo) / 3
        top = tl.full([BLOCK_G, BLOCK_N], -3.0e38, tl.float32)  # running max of the scaled logits
        acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)  # running sum of exp(logit - top)
        for t in range(PAGE):
            logit = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
            for d in range(D):
                qd = tl.load(q_ptr + b * sqb + heads * sqh + d * sqd, mask=g_ok, other=0.0).to(tl.float32)
                lo_d = tl.load(lo_ptr + b * slb + m * slh + n * sln + d, mask=n_ok, other=0.0).to(tl.float32)
                hi_d = tl.load(hi_ptr + b * shb + m * shh + n * shn + d, mask=n_ok, other=0.0).to(tl.float32)
                byte = tl.load(codes_ptr + b * scb + m * sch + n * scn + t * sct + d // 4, mask=n_ok, other=0)
                c = ((byte.to(tl.int32) >> (2 * (d % 4))) & 3).to(tl.float32)  # (BLOCK_N,)
                logit += qd[:, None] * (lo_d + c * (hi_d - lo_d) / 3.0)[None, :]
            logit = logit * scale
            new_top = tl.maximum(top, logit)
            acc = acc * tl.exp(top - new_top) + tl.exp(logit - new_top)
            top = new_top
        raw = (top + tl.log(acc)) / scale
    else:
        for d in range(D):
            qd = tl.load(q_ptr + b * sqb + heads * sqh + d * sqd, mask=g_ok, other=0.0).to(tl.float32)  # (BLOCK_G,)
            # other=0: pages past n_valid hold garbage, maybe NaN
            lo_d = tl.load(lo_ptr + b * slb + m * slh + n * sln + d, mask=n_ok, other=0.0).to(tl.float32)  # (BLOCK_N,)
            hi_d = tl.load(hi_ptr + b * shb + m * shh + n * shn + d, mask=n_ok, other=0.0).to(tl.float32)
            raw += tl.maximum(qd[:, None] * lo_d[None, :], qd[:, None] * hi_d[None, :])

    valid = g_ok[:, None] & n_ok[None, :]
    if REDUCE == 0:  # softmax over pages per query head, then mean over the group
        logits = tl.where(valid, raw * scale, float("-inf"))
        top = tl.maximum(tl.max(logits, axis=1), -3.0e38)  # finite for padded heads / empty rows
        e = tl.exp(logits - top[:, None])
        total = tl.maximum(tl.sum(e, axis=1), 1e-38)
        reduced = tl.sum(e / total[:, None], axis=0) / GROUP  # (BLOCK_N,)
    elif REDUCE == 1:
        reduced = tl.sum(tl.where(valid, raw, 0.0), axis=0) / GROUP
    else:
        reduced = tl.max(tl.where(g_ok[:, None], raw, float("-inf")), axis=0)
    scores = tl.where(n_ok, reduced, float("-inf"))
    tl.store(scores_ptr + b * ssb + m * ssh + n, scores, mask=n < N)

    # top-k: k rounds of "largest score, lowest index among equals", as a stable descending sort
    work = scores
    for j in range(K):
        best = tl.max(work, axis=0)
        pick = tl.min(tl.where((work == best) & (n < N), n, BLOCK_N), axis=0)
        found = best > float("-inf")
        tl.store(index_ptr + b * sib + m * sih + j, tl.where(found, pick, -1).to(tl.int64))
        work = tl.where(n == pick, float("-inf"), work)


def page_scores(q, lo, hi, n_valid, k, scale=1.0, group_reduce="softmax_mean", codes=None):
    assert q.dim() == 3 and lo.dim() == 4, f"q (B, Hq, D) and lo (B, Hkv, N, D), got {tuple(q.shape)}, {tuple(lo.shape)}"
    B, Hq, D = q.shape
    _, Hkv, N, _ = lo.shape
    assert lo.shape == hi.shape and lo.shape[0] == B and lo.shape[3] == D, f"lo {tuple(lo.shape)}, hi {tuple(hi.shape)}, q {tuple(q.shape)}"
    assert Hq % Hkv == 0, f"query heads {Hq} must be a multiple of KV heads {Hkv}"
    assert lo.stride(-1) == hi.stride(-1) == 1, "the digests' channel dim must be contiguous"
    assert n_valid.shape == (B,) and not n_valid.is_floating_point(), f"n_valid must be (B,) int, got {n_valid.shape}"
    assert q.device == lo.device == hi.device == n_valid.device, "all tensors on one device"
    target = configs.target(q.device)
    configs.check_device(target, q)
    assert 1 <= k <= N, f"k must be in [1, {N}], got {k}"
    assert N <= 16384, f"one register tile holds all pages of a head: N = {N} is too many"
    if codes is not None:
        assert codes.dtype == torch.uint8 and codes.shape[:3] == (B, Hkv, N) and codes.shape[4] == (D + 3) // 4, \
            f"codes must be (B, Hkv, N, P, ceil(D / 4)) uint8, got {tuple(codes.shape)} {codes.dtype}"
        assert codes.stride(-1) == 1 and codes.device == q.device, "codes: byte dim contiguous, on q's device"
    cs = codes.stride()[:4] if codes is not None else (0, 0, 0, 0)
    scores = empty((B, Hkv, N), torch.float32, q.device)  # NaN under the interpreter: see empty
    index = torch.full((B, Hkv, k), -7, dtype=torch.int64, device=q.device)
    G = Hq // Hkv
    cfg = configs.page_scores(G, N, target.arch)
    _page_scores_kernel[(B, Hkv)](
        q, lo, hi, n_valid, scores, index, codes if codes is not None else lo,
        float(scale), N, k,
        q.stride(0), q.stride(1), q.stride(2), lo.stride(0), lo.stride(1), lo.stride(2),
        hi.stride(0), hi.stride(1), hi.stride(2),
        scores.stride(0), scores.stride(1), index.stride(0), index.stride(1), *cs,
        GROUP=G, D=D, REDUCE=REDUCE_CODES[group_reduce], HAS_CODES=codes is not None,
        PAGE=codes.shape[3] if codes is not None else 1,
        **cfg.kwargs(),
    )
    return scores, index
