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

With `codes` (beyond the papers; freekv's digest=quant2), the box is Quest's min/max and each key
also keeps a 2-bit code per channel, its place on a 4-level grid across the box:

    k^_{n,t,d} = lo_{n,d} + c_{n,t,d} (hi_{n,d} - lo_{n,d}) / 3,  c in {0, 1, 2, 3}
    P_h[n] = (1 / scale) log sum_{t<P} exp(scale q_h . k^_{n,t})         (approximate page mass)

so that softmax_n(scale P_h)[n] is the share of head h's attention that page n would hold if its
keys were k^. The upper bound ranks pages whose keys spread wide (a loose box) above pages with
one key that matches q; the codes see the key. 2 bits per channel is 1/8 of a bf16 key.

Then the k pages of highest S_m per KV head, ordered by score, ties to the lower page index (a
stable sort): kernel and reference must select the same pages, ties included.

    q        (B, Hq, D)       the query (any strides)
    lo, hi   (B, Hkv, N, D)   page boxes, lo <= hi; pages n >= n_valid[b] hold garbage, never used
    n_valid  (B,) int         candidate pages per row
    k        int <= N         pages to select
    codes    (B, Hkv, N, P, ceil(D / 4)) uint8 or None: 2-bit codes, four channels per byte
             (channel d in bits 2 (d % 4) .. of byte d // 4; pack_codes), lo/hi the min/max box
    -> scores (B, Hkv, N) float32 (-inf at pages >= n_valid),
       index  (B, Hkv, k) int64, descending score; -1 where a row has fewer than k candidates
"""
from __future__ import annotations

import torch

GROUP_REDUCES = ("softmax_mean", "mean", "max")
LEVELS = 3  # the codes' largest value: 2 bits, 4 levels


def pack_codes(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Keys k (..., P, D) in their page's box lo, hi (..., D) -> 2-bit codes (..., P, ceil(D / 4))
    uint8: the nearest of the 4 levels across the box, per channel."""
    width = (hi - lo).float().unsqueeze(-2)
    c = ((k.float() - lo.float().unsqueeze(-2)) / width.clamp_min(1e-30) * LEVELS).round().clamp_(0, LEVELS)
    c = torch.where(width > 0, c, 0).to(torch.uint8)
    D = k.shape[-1]
    c = torch.nn.functional.pad(c, (0, -D % 4)).unflatten(-1, (-1, 4))  # (..., P, ceil(D / 4), 4)
    return (c[..., 0] | c[..., 1] << 2 | c[..., 2] << 4 | c[..., 3] << 6).to(torch.uint8)


def coded_logits(qg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """q . k^ for every coded key: qg (B Hkv, G, D), lo, hi (B, Hkv, N, D), codes (B, Hkv, N, P,
    ceil(D / 4)) -> (B Hkv, G, N, P). The sum the decoded keys k^ and a product would give, regrouped
    by bit plane so that k^ is never built: channel d = 4 i + j is plane j of byte i, and

        q . k^_t = q . lo + sum_j sum_i w_{4i+j} c^(j)_{t,i},   w = q (hi - lo) / 3 per page,

    four products with (P, D / 4) planes (the tests hold it to the unpacked form)."""
    BH, G, D = qg.shape
    N, P, nbytes = codes.shape[2:]
    lo, hi = lo.float().reshape(BH, N, D), hi.float().reshape(BH, N, D)
    w = qg[:, :, None] * ((hi - lo) / LEVELS)[:, None]  # (BH, G, N, D)
    w = torch.nn.functional.pad(w, (0, 4 * nbytes - D)).unflatten(-1, (nbytes, 4))  # (BH, G, N, D / 4, 4)
    out = torch.einsum("bgd,bnd->bgn", qg, lo)[..., None].repeat(1, 1, 1, P)  # q . lo, (BH, G, N, P)
    c = codes.reshape(BH, N, P, nbytes)
    for j in range(4):
        plane = ((c >> 2 * j) & LEVELS).float()  # (BH, N, P, D / 4): channels 4 i + j
        out += torch.einsum("bnpi,bgni->bgnp", plane, w[..., j])
    return out


def page_scores(q, lo, hi, n_valid, k, scale=1.0, group_reduce="softmax_mean", codes=None):
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B * Hkv, G, D)  # the query heads sharing a KV head
    invalid = torch.arange(N, device=q.device) >= n_valid.to(q.device).unsqueeze(1)  # (B, N)
    if codes is not None:  # the approximate page mass, from the keys the codes stand for
        logits = coded_logits(qg, lo, hi, codes).view(B, Hkv, G, N, -1) * scale  # (B, Hkv, G, N, P)
        raw = logits.logsumexp(-1) / scale
    else:
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
