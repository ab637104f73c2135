"""Dense softmax attention with positional masking: the prefill path of every policy, the
attention of a forward without a cache, and the oracle the decode kernels are tested against."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def expand_kv(x: torch.Tensor, n_groups: int) -> torch.Tensor:
    # (B, Hkv, L, D) -> (B, Hkv * n_groups, L, D): query head h reads KV head h // n_groups
    return x if n_groups == 1 else x.repeat_interleave(n_groups, dim=1)


_reused: list | None = None  # inside reusing_results(): [(arguments, output)] of the calls so far


@contextlib.contextmanager
def reusing_results():
    """Inside it, a dense_attention call on the very same tensors as an earlier one (the same
    objects, not modified since) returns that call's output instead of computing it again.

    For a caller that runs several caches on one forward (bench/shared_prefill.py): each policy's
    prefill attends the same q, k, v, and at 16k tokens that attention costs as much as the rest
    of the forward, once per policy. Scoped to one layer's call, so the outputs kept are one
    layer's."""
    global _reused
    outer, _reused = _reused, []
    try:
        yield
    finally:
        _reused = outer


def _version(x):
    # a tensor's in-place change counter; inference tensors keep none, and there identity alone
    # decides (the callers share q, k, v among several caches, none may change them in place)
    return x._version if isinstance(x, torch.Tensor) and not x.is_inference() else None


def _same_call(a: tuple, b: tuple) -> bool:
    # tensors by identity (the kept ones stay alive, so an id is never reused) and version, the
    # rest by value
    return all((x is y and _version(x) == v) if isinstance(x, torch.Tensor) else x == y
               for x, (y, v) in zip(a, b))


def dense_attention(q, k, v, q_pos=None, k_pos=None, window: int | None = None, scale: float | None = None):
    """Causal softmax attention of q over k, v with positional masking.

    q (B, Hq, T, D); k, v (B, Hkv, L, D); q_pos (B, T), k_pos (B, L) int: key j is visible to query
    i when k_pos[j] <= q_pos[i] (and q_pos[i] - k_pos[j] < window). With no positions given, the
    last T keys are the queries themselves (plain causal prefill), which takes SDPA's fused path.
    Inside reusing_results(), a call repeating an earlier one returns that one's output.
    """
    args = (q, k, v, q_pos, k_pos, window, scale)
    if _reused is None:
        return _attention(*args)
    for kept, out in _reused:
        if _same_call(args, kept):
            return out
    out = _attention(*args)
    _reused.append((tuple((x, _version(x)) for x in args), out))
    return out


def _attention(q, k, v, q_pos, k_pos, window, scale):
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
            # bfloat16 / float16: SDPA's CPU kernel takes 4-6x longer for one query row than
            # the float32 products over float32 copies of K and V (SmolLM2, 500 keys: 524 against
            # 128 us a layer; 8,000 keys: 8.1 against 1.3 ms)
            return one_query_attention(q.float(), k.float(), v.float(), scale).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if q_pos is None:
        L, T = k.shape[2], q.shape[2]
        k_pos = torch.arange(L, device=q.device)[None]
        q_pos = torch.arange(L - T, L, device=q.device)[None]
    visible = k_pos[:, None, :] <= q_pos[:, :, None]  # (B, T, L)
    if window is not None:
        visible &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=gqa)


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        hidden: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, 1, D), k, v (B, Hkv, L, D) float32 on a CPU -> (B, Hq, 1, D): a decode step's
    attention as two batched products, the G query heads of a KV head the G rows of one.
    SDPA's CPU kernel is built for many query rows; for one it reads K and V at about 5 GB/s on
    one thread where these products read at 7 (SmolLM2, 8,000 keys: 1.76 against 2.57 ms a layer;
    500 keys: 54 against 61 us). Half-precision callers pass float32 copies (dense_attention).
    hidden (B Hkv, 1, L) bool: keys given weight exactly 0 (a filled -inf; their values must be
    finite, 0 times NaN being NaN); at least one key per row visible."""
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qg = q.reshape(B * Hkv, Hq // Hkv, D)
    scores = torch.bmm(qg, k.reshape(B * Hkv, L, D).transpose(1, 2)).mul_(scale)  # (B Hkv, G, L)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v.reshape(B * Hkv, L, D)).view(B, Hq, 1, D)
