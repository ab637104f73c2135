"""Decode attention over a contiguous KV cache, eager reference: one new query per row.

    q        (B, Hq, D)         the query of the token being decoded
    k, v     (B, Hkv, L_cap, D) preallocated caches; slots >= lengths[b] may hold garbage, even NaN
    lengths  (B,) int           valid tokens per row, >= 1: row b attends to slots [0, lengths[b])
    window   None or int        Mistral's sliding window: only the last `window` valid slots
    -> out   (B, Hq, D) in q's dtype, and with return_lse the log-sum-exp (B, Hq) float32

GQA: query head h reads KV head h // (Hq // Hkv). Scores and softmax are float32 whatever the
cache dtype. The log-sum-exp of the scaled scores lets a caller merge this attention with one
over other tokens (another tier, another split): out = sum_i exp(lse_i - lse) out_i.

Memory traffic: this reference upcasts all of K and V to float32 (the whole capacity, not just the
valid slots: two copies twice the cache's size), materializes scores and probabilities over
L_cap, and writes a masked copy of V before the weighted sum. The kernel reads each valid K/V row
once per KV head, for all the query heads of its group together, keeps scores in registers
(online softmax) and never touches the slots past a row's length. Decoding is bound by that one
read of the cache.
"""
from __future__ import annotations

import math

import torch


def decode_attention(q, k, v, lengths, scale=None, window=None, return_lse=False):
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)

    qg = q.float().reshape(B, Hkv, group, D)  # (B, Hkv, G, D): the query heads sharing a KV head
    scores = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale  # (B, Hkv, G, L)

    vf = v.float()
    if window is not None or bool((lengths != L).any()):
        slot = torch.arange(L, device=q.device)  # (L,)
        n = lengths.to(q.device)[:, None]  # (B, 1)
        visible = slot < n  # (B, L)
        if window is not None:
            visible &= slot >= n - window
        # masked scores are -inf, and each row has at least one visible slot, so softmax has no
        # NaN; where() rather than adding -inf keeps garbage (even NaN) in unused slots out.
        scores = torch.where(visible[:, None, None, :], scores, float("-inf"))
        vf = torch.where(visible[:, None, :, None], vf, 0.0)  # 0 * NaN would still be NaN
    # else every row reads all L slots (the caller sliced the cache to its length): no mask

    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G)
    p = torch.exp(scores - lse[..., None])  # (B, Hkv, G, L), exactly 0 on masked slots
    out = torch.einsum("bhgl,bhld->bhgd", p, vf).reshape(B, Hq, D).to(q.dtype)
    return (out, lse.reshape(B, Hq)) if return_lse else out
