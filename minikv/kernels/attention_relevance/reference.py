"""Decode attention over the active tokens, fused with the soft-freeze relevance scores.
Eager reference.

    q        (B, Hq, D)         the query of the token being decoded (after RoPE)
    k, v     (B, Hkv, L_cap, D) the active KV buffer; slots >= lengths[b] hold garbage, never read
    lengths  (B,) int           active tokens per row, >= 1
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

    qg = q.float().reshape(B, Hkv, group, D)  # (B, Hkv, G, D): the query heads sharing a KV head
    raw = qg @ k.float().transpose(-1, -2)  # (B, Hkv, G, L): q_h . k_j, unscaled

    s = raw.abs().sum(dim=(1, 2)).div_(Hq)  # (B, L) Eq. 2: mean over the Hq query heads of |q_h . k_j|
    scores = raw.mul_(scale)  # in place: raw is not read again (a decode step calls this per layer)
    vf = v.float()  # (B, Hkv, L, D)
    if bool((lengths != L).any()):
        visible = torch.arange(L, device=q.device) < lengths.to(q.device)[:, None]  # (B, L)
        # where() rather than a product keeps garbage slots (maybe NaN) out: 0 * NaN is NaN
        s = torch.where(visible, s, 0.0)
        scores = torch.where(visible[:, None, None, :], scores, float("-inf"))
        vf = torch.where(visible[:, None, :, None], vf, 0.0)
    # else every row reads all L slots (the caller sliced the buffer to the active tokens): no mask
    p = torch.softmax(scores, dim=-1)  # (B, Hkv, G, L), exactly 0 on masked slots
    out = (p @ vf).reshape(B, Hq, D).to(q.dtype)  # (B, Hkv, G, D) -> (B, Hq, D)
    return out, s
