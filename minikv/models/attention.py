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
    last T keys are the queries themselves (plain causal prefill), which takes SDPA's fused path.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # GQA without copies: SDPA maps query head h to KV head h // (Hq // Hkv) itself
    gqa = q.shape[1] != k.shape[1]
    if q_pos is None and window is None and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q_pos is None and window is None and q.shape[2] == 1:
        # one query after all the keys (a decode step): it sees every key, no mask to build
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if q_pos is None:
        L, T = k.shape[2], q.shape[2]
        k_pos = torch.arange(L, device=q.device)[None]
        q_pos = torch.arange(L - T, L, device=q.device)[None]
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # (B, T, L)
    if window is not None:
        visible &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=gqa)
