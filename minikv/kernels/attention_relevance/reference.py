"""Decode attention over the active tokens, fused with the soft-freeze relevance scores.
Eager reference.

    q        (B, Hq, D)         the query of the token being decoded (after RoPE)
    k, v     (B, Hkv, L_cap, D) the active KV buffer; slots >= lengths[b] hold garbage, never read
    lengths  (B,) int           active tokens per row, >= 1; None: every row reads all L_cap slots
    scale    float or None      softmax scale, default 1/sqrt(D)
    -> out   (B, Hq, D) in q's dtype: softmax(q k^T * scale) v over slots [0, lengths[b])
       s     (B, L_cap) float32: the relevance of Eq. 2 of the soft-freeze paper (ASR-KF-EGR),
             s_j = 1/Hq * sum_h |q_h . k_j^(h)|, unscaled (no 1/sqrt(D)); 0 for slots >= length

GQA: query head h reads KV head h // (Hq // Hkv), for attention and for Eq. 2 alike, so s_j is
the mean over *query* heads, each against the key it really attends to.

Why fuse: both results start from the same raw dot products q_h . k_j. Computed apart, the cache
is read twice (once for attention, once for the scores); the kernel reads each K row once and
derives the softmax weights and |q.k| from the same tile in registers. This reference upcasts
K and V to float32 over the whole capacity and materialises the (B, Hkv, G, L_cap) score tensor,
which is what the kernel avoids.
"""
from __future__ import annotations

import math

import torch


def attention_relevance(q, k, v, lengths, scale=None):
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)

    # batch and KV head as one batch dimension for bmm: (B Hkv, G, D) against (B Hkv, D, L). This
    # is what q @ k^T of the 4-d tensors does inside (the same bmm on the same views, so the same
    # bits) without the checks, expands and reshapes around it: a decode step calls this once per
    # layer, and those cost more than the product of a few hundred keys
    qg = _float(q).reshape(B * Hkv, group, D)  # the query heads sharing a KV head
    kt = _float(k).transpose(-1, -2).reshape(B * Hkv, D, L)  # (B Hkv, D, L), a view where it can be (matmul's own reshape)
    raw = torch.bmm(qg, kt)  # (B Hkv, G, L): q_h . k_j, unscaled

    s = raw.view(B, Hq, L).abs().sum(dim=1).div_(Hq)  # (B, L) Eq. 2: mean over the Hq query heads of |q_h . k_j|
    scores = raw.mul_(scale)  # in place: raw is not read again
    vf = _float(v).reshape(B * Hkv, L, D)
    if lengths is not None and any(n != L for n in lengths.tolist()):  # (a list: one call, where a tensor test is three ops)
        visible = torch.arange(L, device=q.device) < lengths.to(q.device)[:, None]  # (B, L)
        # where() rather than a product keeps garbage slots (maybe NaN) out: 0 * NaN is NaN
        s = torch.where(visible, s, 0.0)
        visible = visible.repeat_interleave(Hkv, dim=0)  # (B Hkv, L): row b * Hkv + h is row b's
        scores = torch.where(visible[:, None, :], scores, float("-inf"))
        vf = torch.where(visible[:, :, None], vf, 0.0)
    # else every row reads all L slots (the caller sliced the buffer to the active tokens): no mask
    p = torch.softmax(scores, dim=-1)  # (B Hkv, G, L), exactly 0 on masked slots
    out = torch.bmm(p, vf).view(B, Hq, D)  # (B Hkv, G, D) -> (B, Hq, D)
    return (out if out.dtype == q.dtype else out.to(q.dtype)), s


def _float(t):
    """t in float32: t itself when it is float32 already (t.float() would still dispatch)."""
    return t if t.dtype == torch.float32 else t.float()
