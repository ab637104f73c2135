"""DCI candidate scoring with top-k, Triton kernel.

Grid (B,): program b holds its block's G queries in registers (a BLOCK_G x BLOCK_D tile) and walks
the shared candidate list in blocks of BLOCK_C: gather the keys (ids from cand; padding masked,
never read), one (G x D) . (D x BLOCK_C) product, mask, store the scores. So each candidate key is
read once for the whole block. Then for each query, k passes over its stored scores pick its top
k: pass j takes the largest score after pass j-1's pick in the order (score descending, position
ascending), so ties go to the lower position, as the reference's stable top-k, and nothing needs
to be marked as taken.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import launch as configs
from .._triton import dot as _dot


# counts, and strides that follow them: no recompile as they change (kernels/launch.py)
@triton.jit(do_not_specialize=["C", "K", "scb", "smb", "smg", "ssb", "ssg", "sbb", "sbg"])
def _dci_scores_kernel(
    q_ptr, keys_ptr, heads_ptr, cand_ptr, mask_ptr, scores_ptr, best_ptr,
    C, K,
    sqb, sqg, skh, skn, scb, smb, smg, ssb, ssg, sbb, sbg,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, BLOCK_C)
    q = tl.load(q_ptr + b * sqb + g[:, None] * sqg + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :],
                other=0.0).to(tl.float32)  # (BLOCK_G, BLOCK_D)
    head = tl.load(heads_ptr + b).to(tl.int64)
    for start in range(0, C, BLOCK_C):
        pos = start + c
        ids = tl.load(cand_ptr + b * scb + pos, mask=pos < C, other=-1).to(tl.int64)
        ok = ids >= 0
        k = tl.load(keys_ptr + head * skh + ids[:, None] * skn + d[None, :],
                    mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # (BLOCK_C, BLOCK_D)
        s = _dot(q, tl.trans(k), "ieee", False)  # (BLOCK_G, BLOCK_C)
        m = tl.load(mask_ptr + b * smb + g[:, None] * smg + pos[None, :],
                    mask=(g < G)[:, None] & (pos < C)[None, :], other=0)
        s = tl.where((m != 0) & ok[None, :], s, float("-inf"))
        tl.store(scores_ptr + b * ssb + g[:, None] * ssg + pos[None, :], s, mask=(g < G)[:, None] & (pos < C)[None, :])
    tl.debug_barrier()  # the passes below read what other threads of this program stored

    for gi in range(G):
        row = scores_ptr + b * ssb + gi * ssg
        prev_s = float("inf")
        prev_p = -1
        for j in range(K):
            best_s = float("-inf")
            best_p = C  # past the end: "none"
            for start in range(0, C, BLOCK_C):
                pos = start + c
                s = tl.load(row + pos, mask=pos < C, other=float("-inf"))
                after = (s < prev_s) | ((s == prev_s) & (pos > prev_p))  # after the previous pick
                s = tl.where(after & (pos < C), s, float("-inf"))
                top = tl.max(s, axis=0)
                at = tl.min(tl.where(s == top, pos, C), axis=0)  # (an all -inf block: found stays False)
                better = (top > best_s) | ((top == best_s) & (at < best_p))
                best_s = tl.where(better, top, best_s)
                best_p = tl.where(better, at, best_p)
            found = best_s > float("-inf")
            tl.store(best_ptr + b * sbb + gi * sbg + j, tl.where(found, best_p, -1).to(tl.int64))
            prev_s = tl.where(found, best_s, float("-inf"))
            prev_p = tl.where(found, best_p, C)


def dci_scores(q, keys, heads, cand, mask, k):
    assert q.dim() == 3 and keys.dim() == 3 and cand.dim() == 2, \
        f"q (B, G, D), keys (H, N, D), cand (B, C); got {tuple(q.shape)}, {tuple(keys.shape)}, {tuple(cand.shape)}"
    B, G, D = q.shape
    C = cand.shape[1]
    assert keys.shape[2] == D and cand.shape[0] == B and heads.shape == (B,) and mask.shape == (B, G, C), \
        f"keys {tuple(keys.shape)}, cand {tuple(cand.shape)}, heads {tuple(heads.shape)}, mask {tuple(mask.shape)}"
    assert not cand.is_floating_point() and not heads.is_floating_point() and mask.dtype == torch.bool
    assert q.stride(2) == 1 and keys.stride(2) == 1 and cand.stride(1) == 1 and mask.stride(2) == 1, \
        "the last dims must be contiguous"
    assert heads.is_contiguous(), "heads must be contiguous"
    assert q.device == keys.device == heads.device == cand.device == mask.device, "one device"
    target = configs.target(q.device)
    configs.check_device(target, q)
    assert 0 <= k <= C, f"k must be in [0, {C}], got {k}"
    scores = torch.empty((B, G, C), dtype=torch.float32, device=q.device)
    best = torch.empty((B, G, k), dtype=torch.int64, device=q.device)
    if target.interpreted:  # poisoned: an unwritten element fails loudly
        scores.fill_(float("nan"))
        best.fill_(-7)
    m = mask.view(torch.uint8)
    _dci_scores_kernel[(B,)](
        q, keys, heads, cand, m, scores, best,
        C, k,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), cand.stride(0), m.stride(0), m.stride(1),
        scores.stride(0), scores.stride(1), best.stride(0), best.stride(1),
        G=G, D=D, **configs.dci_scores(G, C, D, target.arch).kwargs(),
    )
    return scores, best
