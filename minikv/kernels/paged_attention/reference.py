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
This reference is that definition, vectorised: one gather of (B, Hkv, N, P, D) keys and values,
float32 scores, a mask from page_lens.

Memory traffic: the gather copies every listed page (N * P * D per KV head, twice) before any
arithmetic, and the masked softmax materialises scores over N * P. The kernel reads each listed
page straight from the pool once for the whole GQA group, and skips the masked tail of a page.
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

    heads = torch.arange(Hkv, device=q.device)[None, :, None]  # (1, Hkv, 1)
    slots = page_table.long()  # (B, Hkv, N)
    # k_pages[slot, :, head] for every table entry: (B, Hkv, N, P, D)
    k = k_pages[slots, :, heads.expand_as(slots)].float()
    v = v_pages[slots, :, heads.expand_as(slots)].float()
    k = k.reshape(B, Hkv, N * P, D)
    v = v.reshape(B, Hkv, N * P, D)
    visible = torch.arange(P, device=q.device) < page_lens.to(q.device)[..., None]  # (B, Hkv, N, P)
    visible = visible.reshape(B, Hkv, 1, N * P)

    qg = q.float().reshape(B, Hkv, G, D)
    scores = torch.einsum("bhgd,bhld->bhgl", qg, k) * scale  # (B, Hkv, G, N * P)
    scores = torch.where(visible, scores, float("-inf"))  # where(): garbage (NaN) never leaks
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G)
    p = torch.exp(scores - lse[..., None])
    v = torch.where(visible.transpose(-1, -2), v, 0.0)  # (B, Hkv, N * P, D); 0 * NaN is NaN
    out = torch.einsum("bhgl,bhld->bhgd", p, v).reshape(B, Hq, D).to(q.dtype)
    return (out, lse.reshape(B, Hq)) if return_lse else out
