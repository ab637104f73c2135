"""Decode attention over a paged KV cache through a per-KV-head page table, eager reference.

The device tier keeps KV in pages of P tokens, NHD layout (FreeKV's device layout): one slot of
the pool is (P, Hkv, D), all KV heads of P tokens. KV head m of row b reads the slots listed in
its own row of the page table, page_table[b, m, :], and of table entry j only the first
page_lens[b, m, j] tokens: the partly filled last page is masked, never padded into attention,
and an entry of length 0 is unused. Different KV heads may read different slots (FreeKV selects
pages per KV head), or the same slot (sink and recent pages are shared by all heads).

    q           (B, Hq, D)          the query of the token being decoded (any strides)
    k_pages     (S, P, Hkv, D)      the device pool, NHD; v_pages likewise
    page_table  (B, Hkv, N) int     slot of table entry j of KV head m
    page_lens   (B, Hkv, N) int     valid tokens in that slot, 0..P; >= 1 token per (b, m) in all
    -> out      (B, Hq, D) in q's dtype, and with return_lse the log-sum-exp (B, Hq) float32

The oracle the tests use is the definition: gather the listed tokens and run dense attention.
This reference is that definition, vectorised: one index_select of the (B, Hkv, N, P) listed
token rows of the pool for keys and one for values, float32 scores, a mask from page_lens. (One
flat gather rather than advanced indexing k_pages[slots, :, heads]: at decode sizes the cost is
the number of operations, not the bytes.)
"""
from __future__ import annotations

import math

import torch


def paged_attention(q, k_pages, v_pages, page_table, page_lens, scale=None, return_lse=False):
    B, Hq, D = q.shape
    S, P, Hkv, _ = k_pages.shape
    N = page_table.shape[-1]
    G = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)

    # One gather for every row, KV head and table entry: viewed as (S * P * Hkv, D), row
    # (s * P + t) * Hkv + m of the pool is token t of KV head m in slot s. (Index arithmetic in
    # the table's dtype: index_select takes int32 and int64 alike.)
    t = torch.arange(P, dtype=page_table.dtype, device=q.device)  # (P,) token within a page
    heads = torch.arange(Hkv, dtype=page_table.dtype, device=q.device).view(1, Hkv, 1)
    first = page_table * (P * Hkv) + heads  # (B, Hkv, N): row of token 0 of each entry
    rows = (first.unsqueeze(-1) + t * Hkv).view(-1)  # (B * Hkv * N * P,) the listed tokens, in table order
    k = k_pages.reshape(-1, D).index_select(0, rows).view(B * Hkv, N * P, D).float()
    v = v_pages.reshape(-1, D).index_select(0, rows).view(B * Hkv, N * P, D).float()
    # masked: the tail of the partly filled last page, unused entries (length 0)
    hidden = (t >= page_lens.unsqueeze(-1)).view(B * Hkv, 1, N * P)

    qg = q.float().reshape(B * Hkv, G, D)  # the query heads sharing a KV head
    scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)  # (B * Hkv, G, N * P)
    scores.masked_fill_(hidden, float("-inf"))  # a fill, not an added -inf: garbage (NaN) never leaks
    # softmax by hand (each row has a visible token, so the max is finite), keeping the lse
    m = scores.amax(-1, keepdim=True)  # (B * Hkv, G, 1)
    p = torch.exp(scores - m)  # exactly 0 on masked tokens
    total = p.sum(-1, keepdim=True)
    v.masked_fill_(hidden.transpose(1, 2), 0.0)  # (B * Hkv, N * P, D), a fresh gather; 0 * NaN is NaN
    out = torch.bmm(p, v).div_(total).reshape(B, Hq, D).to(q.dtype)
    if not return_lse:
        return out
    return out, (m + total.log()).reshape(B, Hq)
