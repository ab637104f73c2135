"""Decode attention over a gathered cache: per KV head, a list of slots of its own KV. Eager
reference.

SyncKV's non-representative heads read only the tokens their cluster's representative chose
(Sec. 4.4, Eq. 8; Algorithm 1 line 24: Attention(q_t, K_NR[I_sparse], V_NR[I_sparse])), and
different KV heads read different lists. So each KV head m of row b attends to the slots
index[b, m, :] of k[b, m] and v[b, m]; -1 marks an unused entry (the lists are padded to one
length). The query heads of a GQA group read their KV head's list.

    q      (B, Hq, D)          the query of the token being decoded (any strides)
    k, v   (B, Hkv, L_cap, D)  the KV store; unlisted slots may hold garbage, even NaN
    index  (B, Hkv, N) int     slots to read, distinct within a row, -1 = none; >= 1 slot per (b, m)
    -> out (B, Hq, D) in q's dtype, and with return_lse the log-sum-exp (B, Hq) float32

The oracle the tests use is the definition: gather the listed rows, run dense attention. This
reference is that definition, vectorised (one gather of the listed K and V rows, a mask for -1).

Memory traffic: the gather copies the N listed rows of K and V per KV head (upcast to float32)
before any arithmetic; the kernel loads each listed row straight from the store, once for the
whole GQA group, and never touches unlisted slots.
"""
from __future__ import annotations

import math

import torch


def gathered_attention(q, k, v, index, scale=None, return_lse=False):
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], index.shape[-1]
    G = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    listed = index >= 0  # (B, Hkv, N)
    rows = index.clamp_min(0).long().unsqueeze(-1).expand(B, Hkv, N, D)
    kg = torch.gather(k, 2, rows).float()  # (B, Hkv, N, D): the listed keys, in list order
    vg = torch.gather(v, 2, rows).float()
    qg = q.float().reshape(B, Hkv, G, D)  # the query heads sharing a KV head
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, kg) * scale  # (B, Hkv, G, N)
    # fills, not products: a -1 entry gathered slot 0, whose garbage (maybe NaN) must not leak
    scores = scores.masked_fill(~listed[:, :, None, :], float("-inf"))
    vg = vg.masked_fill(~listed[..., None], 0.0)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G): each row lists >= 1 slot, so finite
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhgn,bhnd->bhgd", p, vg).reshape(B, Hq, D).to(q.dtype)
    return (out, lse.reshape(B, Hq)) if return_lse else out
