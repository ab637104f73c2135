"""Dense softmax attention with positional masking: the prefill path of every policy, the
attention of a forward without a cache, and the oracle the decode kernels are tested against."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def expand_kv(x: torch.Tensor, n_groups: int) -> torch.Tensor:
    # (B, Hkv, L, D) -> (B, Hkv * n_groups, L, D): query head h reads KV head h // n_groups
    return x if n_groups == 1 else x.repeat_interleave(n_groups, dim=1)


def dense_attention(q, k, v, q_pos=None, k_pos=None, window: int | None = None, scale: float | None = None):
    """Causal softmax attention of q over k, v with positional masking.

    q (B, Hq, T, D); k, v (B, Hkv, L, D); q_pos (B, T), k_pos (B, L) int: key j is visible to query
    i when k_pos[j] <= q_pos[i] (and q_pos[i] - k_pos[j] < window). With no positions given, the
    last T keys are the queries themselves (plain causal prefill), which takes SDPA's fused path;
    with a window as well, windowed_attention's blocks (no T x L mask, however long the prompt).
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # GQA without copies: SDPA maps query head h to KV head h // (Hq // Hkv) itself
    gqa = q.shape[1] != k.shape[1]
    if q_pos is None and window is None and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q_pos is None and window is None and q.shape[2] == 1:
        # one query after all the keys (a decode step): it sees every key, no mask to build
        if q.device.type == "cpu":
            if q.dtype == torch.float32:
                return one_query_attention(q, k, v, scale)
            # bfloat16 / float16: SDPA's CPU kernel is slower for one query row than the
            # float32 products over float32 copies of K and V
            return one_query_attention(q.float(), k.float(), v.float(), scale).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if q_pos is None and window is not None:
        return windowed_attention(q, k, v, window, scale)
    if q_pos is None:
        L, T = k.shape[2], q.shape[2]
        k_pos = torch.arange(L, device=q.device)[None]
        q_pos = torch.arange(L - T, L, device=q.device)[None]
    return masked_attention(q, k, v, q_pos, k_pos, window, scale)


def masked_attention(q, k, v, q_pos, k_pos, window: int | None, scale: float):
    """q (B, Hq, T, D); k, v (B, Hkv, L, D); q_pos (B, T), k_pos (B, L) -> (B, Hq, T, D): key j
    visible to query i when k_pos[j] <= q_pos[i] and q_pos[i] - k_pos[j] < window. Builds the
    (B, T, L) mask: the caller keeps T x L small (windowed_attention does, for a long prompt)."""
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # (B, T, L)
    if window is not None:
        visible &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def windowed_attention(q, k, v, window: int, scale: float, block: int | None = None):
    """Causal sliding-window attention of the last T of L keys' queries, in O(T x window) time and
    memory: the prefill of a local layer (Gemma 3's 512-token windows, a Mistral's).

    q (B, Hq, T, D); k, v (B, Hkv, L, D), L >= T, query i at key index L - T + i -> (B, Hq, T, D).
    Query i sees keys L - T + i - window < j <= L - T + i, so a block of queries [s, e) needs only
    the keys from L - T + s - window + 1 to L - T + e - 1: each block of `block` (default window)
    query rows attends over at most block + window - 1 keys, and the mask and scores built are
    (block, block + window - 1) per block instead of (T, L). The result is the one-mask form's,
    block by block (masked_attention with positions 0..L-1)."""
    B, Hq, T, _ = q.shape
    L, block = k.shape[2], block or window
    out = q.new_empty(B, Hq, T, v.shape[-1])  # (B, Hq, T, Dv)
    for s in range(0, T, block):
        e = min(s + block, T)
        lo, hi = max(L - T + s - window + 1, 0), L - T + e  # keys [lo, hi) of queries [s, e)
        k_pos = torch.arange(lo, hi, device=q.device)[None]  # (1, hi - lo)
        q_pos = torch.arange(L - T + s, hi, device=q.device)[None]  # (1, e - s): the block's last keys
        out[:, :, s:e] = masked_attention(q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi], q_pos, k_pos, window, scale)
    return out


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        hidden: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, 1, D), k, v (B, Hkv, L, D) float32 on a CPU -> (B, Hq, 1, D): a decode step's
    attention as two batched products, the G query heads of a KV head the G rows of one.
    SDPA's CPU kernel is built for many query rows; for one, these products read K and V faster.
    Half-precision callers pass float32 copies (dense_attention).
    hidden (B Hkv, 1, L) bool: keys given weight exactly 0 (a filled -inf; their values must be
    finite, 0 times NaN being NaN); at least one key per row visible."""
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qg = q.reshape(B * Hkv, Hq // Hkv, D)
    scores = torch.bmm(qg, k.reshape(B * Hkv, L, D).transpose(1, 2)).mul_(scale)  # (B Hkv, G, L)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v.reshape(B * Hkv, L, D)).view(B, Hq, 1, D)
