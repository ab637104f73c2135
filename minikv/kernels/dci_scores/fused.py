"""DCI candidate scoring with top-k, Triton kernel.

Grid (R,): program r holds its query row in registers and walks its candidate list in blocks of
BLOCK_C: gather the keys (ids from cand, padding masked, never read), q . k in float32, store the
scores. Then k passes over the stored scores pick the top k: pass j takes the largest score that
comes after pass j-1's pick in the order (score descending, position ascending), so ties go to
the lower position, as the reference's stable sort, and nothing needs to be marked as taken.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import triton_interpreted


@triton.jit
def _dci_scores_kernel(
    q_ptr, keys_ptr, heads_ptr, cand_ptr, scores_ptr, best_ptr,
    C, K,
    sqr, skh, skn, scr, ssr, sbr,
    D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    c = tl.arange(0, BLOCK_C)
    q = tl.load(q_ptr + r * sqr + d, mask=d < D, other=0.0).to(tl.float32)  # (BLOCK_D,)
    head = tl.load(heads_ptr + r).to(tl.int64)
    for start in range(0, C, BLOCK_C):
        pos = start + c
        ids = tl.load(cand_ptr + r * scr + pos, mask=pos < C, other=-1).to(tl.int64)
        ok = ids >= 0
        k = tl.load(keys_ptr + head * skh + ids[:, None] * skn + d[None, :],
                    mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # (BLOCK_C, BLOCK_D)
        s = tl.sum(k * q[None, :], axis=1)
        tl.store(scores_ptr + r * ssr + pos, tl.where(ok, s, float("-inf")), mask=pos < C)
    tl.debug_barrier()  # the passes below read what other threads of this program stored

    prev_s = float("inf")
    prev_p = -1
    for j in range(K):
        best_s = float("-inf")
        best_p = C  # past the end: "none"
        for start in range(0, C, BLOCK_C):
            pos = start + c
            s = tl.load(scores_ptr + r * ssr + pos, mask=pos < C, other=float("-inf"))
            after = (s < prev_s) | ((s == prev_s) & (pos > prev_p))  # after the previous pick
            s = tl.where(after & (pos < C), s, float("-inf"))
            top = tl.max(s, axis=0)
            at = tl.min(tl.where(s == top, pos, C), axis=0)  # (an all -inf block: found stays False)
            better = (top > best_s) | ((top == best_s) & (at < best_p))
            best_s = tl.where(better, top, best_s)
            best_p = tl.where(better, at, best_p)
        found = best_s > float("-inf")
        tl.store(best_ptr + r * sbr + j, tl.where(found, best_p, -1).to(tl.int64))
        prev_s = tl.where(found, best_s, float("-inf"))
        prev_p = tl.where(found, best_p, C)


def dci_scores(q, keys, heads, cand, k):
    assert q.dim() == 2 and keys.dim() == 3 and cand.dim() == 2, \
        f"q (R, D), keys (H, N, D), cand (R, C); got {tuple(q.shape)}, {tuple(keys.shape)}, {tuple(cand.shape)}"
    R, D = q.shape
    C = cand.shape[1]
    assert keys.shape[2] == D and cand.shape[0] == R and heads.shape == (R,), \
        f"keys {tuple(keys.shape)}, cand {tuple(cand.shape)}, heads {tuple(heads.shape)} for q {tuple(q.shape)}"
    assert not cand.is_floating_point() and not heads.is_floating_point(), "cand and heads are ints"
    assert q.stride(1) == 1 and keys.stride(2) == 1 and cand.stride(1) == 1, "the last dims must be contiguous"
    assert heads.is_contiguous(), "heads must be contiguous"
    assert q.device == keys.device == heads.device == cand.device, "one device"
    assert 1 <= k <= C, f"k must be in [1, {C}], got {k}"
    scores = torch.empty((R, C), dtype=torch.float32, device=q.device)
    best = torch.empty((R, k), dtype=torch.int64, device=q.device)
    if triton_interpreted():  # poisoned: an unwritten element fails loudly
        scores.fill_(float("nan"))
        best.fill_(-7)
    _dci_scores_kernel[(R,)](
        q, keys, heads, cand, scores, best,
        C, k,
        q.stride(0), keys.stride(0), keys.stride(1), cand.stride(0), scores.stride(0), best.stride(0),
        D=D, BLOCK_C=min(128, max(16, triton.next_power_of_2(C))), BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return scores, best
