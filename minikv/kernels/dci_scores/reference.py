"""DCI candidate scoring, eager reference (IceCache, Algorithm 4's exact step).

The tree search of IceCache (minikv/policies/dci.py) decides *which* keys to look at from their
projections; this operation then scores them exactly. Query row r belongs to KV head heads[r]
and brings its own list of candidate key ids; each is scored by the inner product q_r . k (the
MIPS transform of Eqs. 2-3 makes the nearest transformed key the one of largest q . k, so the
DCI distance -q . k ranks the same way), and the k best positions are returned, best first:

    q      (R, D)      query rows (any float dtype; scored in float32)
    keys   (H, N, D)   the tree's keys per KV head
    heads  (R,) int    KV head of each row
    cand   (R, C) int  candidate key ids in [0, N), -1 = padding (rows have different counts)
    k      int         1 <= k <= C
    -> scores (R, C) float32, -inf at padding
       best   (R, k) int64 positions into cand, by descending score, ties to the lower
              position (a stable sort); -1 where a row has fewer than k candidates

Memory traffic: the reference gathers the (R, C, D) candidate keys into a temporary before the
products and sorts all C scores; the kernel reads each candidate key straight from `keys` once,
keeps the row's query in registers, and finds the top k in k passes over the C scores.
"""
from __future__ import annotations

import torch


def stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """values (R, N) float32 -> (R, k) int64 positions of the k largest, descending, ties to the
    lower position: what a stable descending sort would put first, without sorting all N. The
    float's bits are mapped to an int of the same order and the position appended below them,
    so one exact integer top-k decides everything."""
    R, N = values.shape
    assert N < 2**24, f"stable_topk handles fewer than 2**24 values per row, got {N}"
    bits = values.float().contiguous().view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float's value
    key = ordered * 2**24 + (2**24 - 1 - torch.arange(N, device=values.device))
    return key.topk(k, dim=1).indices


def dci_scores(q, keys, heads, cand, k):
    R, C = cand.shape
    H, N, D = keys.shape
    valid = cand >= 0
    # one flat gather of the (R, C) candidate rows of keys viewed as (H * N, D)
    flat = (heads.long()[:, None] * N + cand.clamp_min(0)).view(-1)
    rows = keys.reshape(H * N, D).index_select(0, flat).view(R, C, D)
    scores = torch.bmm(rows.float(), q.float()[:, :, None])[:, :, 0]  # (R, C) q . k
    scores = scores.masked_fill(~valid, float("-inf"))
    best = stable_topk(scores, k)
    best = best.masked_fill(scores.gather(1, best) == float("-inf"), -1)
    return scores, best
