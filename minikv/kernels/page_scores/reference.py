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
    lo, hi   (B, Hkv, N, D)   page boxes, lo <= hi; pages n >= n_valid[b] hold garbage, never used
    n_valid  (B,) int         candidate pages per row
    k        int <= N         pages to select
    -> scores (B, Hkv, N) float32 (-inf at pages >= n_valid),
       index  (B, Hkv, k) int64, descending score; -1 where a row has fewer than k candidates

Memory traffic: the reference reads the digests in two matmuls (q+ against hi, q- against lo; see
the code) and materialises the per-head scores and softmax; the kernel reads each digest row
once per KV head for the whole group and keeps scores in registers through the reduction and
the top-k.
"""
from __future__ import annotations

import torch

GROUP_REDUCES = ("softmax_mean", "mean", "max")


def page_scores(q, lo, hi, n_valid, k, scale=1.0, group_reduce="softmax_mean"):
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B * Hkv, G, D)  # the query heads sharing a KV head
    invalid = torch.arange(N, device=q.device) >= n_valid.to(q.device).unsqueeze(1)  # (B, N)
    # A box has lo <= hi, so max(q_d lo_d, q_d hi_d) is q_d hi_d where q_d > 0 and q_d lo_d where
    # q_d < 0: P_h = q+ . hi + q- . lo, two matmuls (q+ = max(q, 0), q- = min(q, 0)) rather than
    # (B, Hkv, G, N, D) temporaries of q * lo and q * hi.
    hi_t = hi.float().reshape(B * Hkv, N, D).transpose(1, 2)  # (B * Hkv, D, N)
    lo_t = lo.float().reshape(B * Hkv, N, D).transpose(1, 2)
    raw = torch.bmm(qg.clamp_min(0), hi_t).add_(torch.bmm(qg.clamp_max(0), lo_t))  # P_h per query head
    raw = raw.view(B, Hkv, G, N)
    # pages past n_valid may hold garbage, even NaN: their P_h is never used, every path below
    # overwrites it through a masked_fill on `invalid` (a fill, not a product: NaN cannot leak)
    if group_reduce == "softmax_mean":
        logits = (raw * scale).masked_fill_(invalid.view(B, 1, 1, N), float("-inf"))
        m = logits.amax(-1, keepdim=True).clamp_min(-3.0e38)  # finite even when a row has no page
        e = torch.exp(logits - m)
        reduced = (e / e.sum(-1, keepdim=True).clamp_min(1e-38)).sum(2) / G  # (B, Hkv, N): the group mean
    elif group_reduce == "mean":
        reduced = raw.sum(2) / G
    elif group_reduce == "max":
        reduced = raw.amax(2)
    else:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCES}, got {group_reduce!r}")
    scores = reduced.masked_fill_(invalid.view(B, 1, N), float("-inf"))  # (B, Hkv, N)

    # stable descending sort: equal scores keep index order, so ties go to the lower page
    picked, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    index = order[..., :k].masked_fill_(picked[..., :k] == float("-inf"), -1)  # (B, Hkv, k)
    return scores, index
