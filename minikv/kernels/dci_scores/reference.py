"""DCI candidate scoring, eager reference (IceCache, Algorithm 4's exact step).

The tree search of IceCache (minikv/policies/icecache/search.py, batched in search_fast.py)
decides *which* keys to look at from their projections; this operation scores them exactly. A block b is the G queries of one KV head
heads[b] (a GQA group, or several query positions of one head): they share one candidate list,
the union of the keys their searches visit, so each candidate key is read once for the block;
mask[b, g] says which of them query g visits itself. Each visited key is scored by the inner
product q . k (the MIPS transform of Eqs. 2-3 makes the nearest transformed key the one of
largest q . k, so the DCI distance -q . k ranks the same way), and each query's k best positions
are returned, best first:

    q      (B, G, D)    query blocks (any float dtype; scored in float32)
    keys   (H, N, D)    the tree's keys per KV head
    heads  (B,) int     KV head of each block
    cand   (B, C) int   candidate key ids in [0, N), -1 = padding (blocks have different counts)
    mask   (B, G, C)    bool: query g of block b scores candidate c
    k      int          0 <= k <= C (0: the scores only)
    -> scores (B, G, C) float32, -inf where not scored (padding or masked)
       best   (B, G, k) int64 positions into cand, by descending score, ties to the lower
              position (a stable sort); -1 where a query scored fewer than k candidates

Memory traffic: the reference gathers the (B, C, D) candidate keys into a temporary and sorts
nothing (an exact integer top-k, stable_topk); the kernel reads each candidate key straight from
`keys` once per block, keeps the block's queries in registers, and finds each query's top k in k
passes over its C scores.
"""
from __future__ import annotations

import torch


SORT_BELOW = 128


def float_order(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [0, 2**32) with the same order (the float's bits, negatives flipped)."""
    bits = (x.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31


def stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """values (..., N) float32 -> (..., k) int64 positions of the k largest, descending, ties to
    the lower position: what a stable descending sort would put first, without sorting all N. The
    float's bits are mapped to an int of the same order and the position appended below them,
    so one exact integer top-k decides everything."""
    N = values.shape[-1]
    assert N < 2**24, f"stable_topk handles fewer than 2**24 values per row, got {N}"
    if N <= SORT_BELOW:  # short rows: one stable sort costs less than the integer keys' few passes
        return values.sort(dim=-1, descending=True, stable=True).indices[..., :k].contiguous()
    key = float_order(values) * 2**24 + (2**24 - 1 - torch.arange(N, device=values.device))
    return key.topk(k, dim=-1).indices


def dci_scores(q, keys, heads, cand, mask, k):
    B, C = cand.shape
    H, N, D = keys.shape
    # one flat gather of the (B, C) candidate rows of keys viewed as (H * N, D)
    flat = (heads.long()[:, None] * N + cand.clamp_min(0)).view(-1)
    rows = keys.reshape(H * N, D).index_select(0, flat).view(B, C, D)
    scores = torch.bmm(q.float(), rows.float().transpose(1, 2))  # (B, G, C) q . k
    scores = scores.masked_fill_(~(mask & (cand >= 0)[:, None]), float("-inf"))
    return scores, ranked(scores, k)


def ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (B, G, C), -inf where not scored -> (B, G, k) int64 positions of the k best, by
    descending score, ties to the lower position, -1 past the scored."""
    if k == 0:  # scores only (the search's last level ranks nothing)
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.int64, device=scores.device)
    best = stable_topk(scores, k)
    return best.masked_fill_(scores.gather(2, best) == float("-inf"), -1)
