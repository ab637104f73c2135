"""Page scores with group reduction and top-k per KV head, eager reference (FreeKV Sec. "Speculative
retrieval", group-consistent selection; Quest's page upper bound).

Each candidate page n of KV head m is summarised by a box [lo_n, hi_n] of its keys, per channel
(Quest: lo = min, hi = max over the page's tokens; ArkVale: a box around the centre). The score of
query head h for page n is the largest q . k over the box,

    P_h[n] = sum_d max(q_d lo_{n,d}, q_d hi_{n,d})                         (Quest upper bound)

and the query heads of a GQA group (G = Hq / Hkv heads sharing KV head m) are reduced to one score
per page so that the whole group reads the same pages (FreeKV: group-consistent selection):

    softmax_mean  S_m[n] = 1/G sum_{j<G} softmax_n(scale * P_{mG+j})[n]   (FreeKV's default)
    mean          S_m[n] = 1/G sum_{j<G} P_{mG+j}[n]
    max           S_m[n] = max_{j<G} P_{mG+j}[n]

Then the k pages of highest S_m per KV head, ordered by score, ties to the lower page index (a
stable sort): kernel and reference must select the same pages, ties included.

    q        (B, Hq, D)       the query (any strides)
    lo, hi   (B, Hkv, N, D)   page boxes; pages n >= n_valid[b] hold garbage, never read
    n_valid  (B,) int         candidate pages per row
    k        int <= N         pages to select
    -> scores (B, Hkv, N) float32 (-inf at pages >= n_valid),
       index  (B, Hkv, k) int64, descending score; -1 where a row has fewer than k candidates

Memory traffic: the reference materialises q * lo and q * hi as (B, Hq, N, D) float32 tensors (G
times the digests, twice) and the per-head scores; the kernel reads each digest row once per KV
head for the whole group and keeps scores in registers through the reduction and the top-k.
"""
from __future__ import annotations

import torch

GROUP_REDUCES = ("softmax_mean", "mean", "max")


def page_scores(q, lo, hi, n_valid, k, scale=1.0, group_reduce="softmax_mean"):
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, 1, D)  # (B, Hkv, G, 1, D)
    valid = torch.arange(N, device=q.device)[None, :] < n_valid.to(q.device)[:, None]  # (B, N)
    # garbage (even NaN) in pages past n_valid must not reach the softmax: zero them first
    lo_f = torch.where(valid[:, None, :, None], lo.float(), 0.0)[:, :, None]  # (B, Hkv, 1, N, D)
    hi_f = torch.where(valid[:, None, :, None], hi.float(), 0.0)[:, :, None]
    raw = torch.maximum(qg * lo_f, qg * hi_f).sum(-1)  # (B, Hkv, G, N): P_h per query head
    mask = valid[:, None, None, :]  # (B, 1, 1, N)
    if group_reduce == "softmax_mean":
        logits = torch.where(mask, raw * scale, float("-inf"))
        m = logits.amax(-1, keepdim=True).clamp_min(-3.0e38)  # finite even when a row has no page
        e = torch.exp(logits - m)
        reduced = (e / e.sum(-1, keepdim=True).clamp_min(1e-38)).mean(2)  # (B, Hkv, N)
    elif group_reduce == "mean":
        reduced = raw.mean(2)
    elif group_reduce == "max":
        reduced = raw.amax(2)
    else:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCES}, got {group_reduce!r}")
    scores = torch.where(valid[:, None, :], reduced, float("-inf"))  # (B, Hkv, N)

    # stable descending sort: equal scores keep index order, so ties go to the lower page
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]  # (B, Hkv, k)
    picked = scores.gather(-1, order)
    index = torch.where(picked > float("-inf"), order, -1)
    return scores, index
