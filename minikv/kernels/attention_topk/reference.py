"""SyncKV's token selection: a KV head's attention, max-pooled over its GQA group, and its top-k.
Eager reference.

SyncKV (Sec. 4.2 Eq. 3, Sec. 4.3 Eqs. 5-6) lets a representative KV head choose the tokens its
cluster reads: the top k of its attention scores A = softmax(q K^T / sqrt(d)). With GQA a KV head
serves G query heads, so (Appendix B.1) their attention maps are max-pooled into one:

    A_m[j] = max_{g < G} exp(scale * q_{mG+g} . k_j - lse_{mG+g})

where lse_h is the log-sum-exp of query head h's scaled scores over *all* the tokens it attends
to (the decode attention returns it), so that A_m is the attention itself, not a logit: heads
with a flat distribution do not outvote a head that puts all its weight on one token.

    q      (B, Hq, D)          the queries (any strides)
    k      (B, Hkv, L_cap, D)  the keys; slots >= n_valid[b] may hold garbage, even NaN
    lse    (B, Hq) float32     each query head's log-sum-exp over the tokens it attended to
    n_valid (B,) int           candidate tokens per row: slots [0, n_valid[b])
    keep   (B, Hkv, L_cap) bool or None   False excludes a token (SyncKV: the static set)
    k_top  int                 tokens to select
    -> scores (B, Hkv, L_cap) float32: A_m, -inf where not a candidate,
       index  (B, Hkv, k_top) int64: descending score, ties to the lower token (a stable sort);
              -1 where a row has fewer than k_top candidates

Memory traffic: the reference upcasts the keys, materialises every query head's scores (B, Hkv,
G, L_cap) and sorts the whole row; the kernel reads each key once for the whole group, keeps the
G scores in registers, writes one pooled score per token, then picks the k_top largest.
"""
from __future__ import annotations

import math

import torch


def attention_topk(q, k, lse, n_valid, keep, k_top, scale=None):
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    qg = q.float().reshape(B, Hkv, G, D)  # the query heads sharing a KV head
    logits = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale  # (B, Hkv, G, L)
    probs = torch.exp(logits - lse.float().reshape(B, Hkv, G, 1))  # each head's attention weights
    pooled = probs.amax(dim=2)  # (B, Hkv, L): App. B.1's max-pool over the group
    candidate = torch.arange(L, device=q.device) < n_valid.to(q.device)[:, None]  # (B, L)
    candidate = candidate[:, None, :].expand(B, Hkv, L)
    if keep is not None:
        candidate = candidate & keep.to(q.device)
    # a fill, not a product: garbage (NaN) past n_valid never reaches the sort
    scores = pooled.masked_fill(~candidate, float("-inf"))
    return scores, stable_topk(scores, k_top)


def stable_topk(scores, k_top):
    """The first k_top of a stable descending sort of scores (B, H, L) (equal scores: the lower
    token first), -1 where the score is -inf or past L. torch.topk breaks ties arbitrarily and a
    full sort costs O(L log L) every anticipation, so: the k-th largest value by topk, every token
    above it, and of those equal to it the lowest-numbered ones; then a stable sort of just those."""
    B, H, L = scores.shape
    k = min(k_top, L)
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # (B, H, 1)
    above = scores > kth
    tied = scores == kth
    need = k - above.sum(-1, keepdim=True)  # how many of the tied tokens still fit
    take = above | (tied & (tied.cumsum(-1) <= need))  # exactly k per row, in token order
    tokens = take.nonzero()[:, 2].view(B, H, k)
    picked, order = torch.sort(scores.gather(-1, tokens), dim=-1, descending=True, stable=True)
    index = tokens.gather(-1, order).masked_fill_(picked == float("-inf"), -1)
    if k < k_top:  # fewer tokens than k_top
        index = torch.nn.functional.pad(index, (0, k_top - k), value=-1)
    return index
