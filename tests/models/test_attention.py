"""models/attention.py: a decode step's attention on a CPU in float32 (two batched products)
equals PyTorch's fused SDPA, on GQA groups, batches and a cache read through a slice; a sliding-window
prefill in blocks equals the one-mask form and builds no (T, T) mask."""
import math

import pytest
import torch
import torch.nn.functional as F

from minikv.models.attention import dense_attention, windowed_attention


@pytest.mark.parametrize("B,Hq,Hkv,L", [(1, 9, 3, 1), (1, 9, 3, 517), (2, 8, 2, 64), (1, 4, 4, 300)])
def test_one_query_attention_equals_sdpa(B, Hq, Hkv, L):
    g = torch.Generator().manual_seed(L)
    D = 64
    cache_k = torch.randn(B, Hkv, L + 40, D, generator=g) * 3  # a preallocated cache, read up to L
    cache_v = torch.randn(B, Hkv, L + 40, D, generator=g)
    k, v = cache_k[:, :, :L], cache_v[:, :, :L]
    q = torch.randn(B, Hq, 1, D, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
    out = dense_attention(q, k, v)
    assert out.shape == (B, Hq, 1, D)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the last key made the one each group's first query weighs most, with its own value: the
    # output moves to that value
    k[:, :, -1] = q[:, ::Hq // Hkv, 0] * 10
    v[:, :, -1] = 100.0
    assert (dense_attention(q, k, v)[:, ::Hq // Hkv] > 50).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_attention_is_the_float32_one_rounded(dtype):
    """bfloat16 / float16 on a CPU: the float32 computation over the same (half-precision) q, k,
    v, rounded once at the end (within one unit of the half type's rounding of the exact result),
    and close to SDPA's own half-precision result."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D = 1, 9, 3, 300, 64
    k = (torch.randn(B, Hkv, L + 20, D, generator=g) * 3).to(dtype)[:, :, :L]
    v = torch.randn(B, Hkv, L + 20, D, generator=g).to(dtype)[:, :, :L]
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    out = dense_attention(q, k, v)
    assert out.dtype == dtype and out.shape == (B, Hq, 1, D)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    eps = torch.finfo(dtype).eps  # one rounding of a float32 result: relative error <= eps / 2
    torch.testing.assert_close(out.float(), exact, rtol=eps, atol=eps)
    sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, sdpa, rtol=2e-2, atol=2e-2)


def sliding_window_oracle(q, k, v, window):
    """The windowed prefill written out: one (T, L) mask, query i (key index L - T + i) sees key j
    when 0 <= L - T + i - j < window; softmax over the visible scores, in float64."""
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    kk, vv = (x.double().repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))  # (B, Hq, L, D)
    scores = q.double() @ kk.transpose(-1, -2) / math.sqrt(D)  # (B, Hq, T, L)
    gap = (torch.arange(L - T, L)[:, None] - torch.arange(L)[None])  # (T, L) query minus key index
    scores = scores.masked_fill(~((gap >= 0) & (gap < window)), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vv).float()


@pytest.mark.parametrize("B,Hq,Hkv,T,L,window", [
    (1, 4, 1, 1, 1, 8), (1, 4, 1, 7, 7, 8), (1, 4, 1, 8, 8, 8), (2, 4, 1, 9, 9, 8), (2, 6, 2, 37, 37, 8),
    (3, 4, 4, 100, 100, 16), (2, 8, 2, 70, 70, 1), (1, 4, 2, 23, 31, 8), (2, 4, 1, 5, 40, 8)])
def test_windowed_prefill_equals_the_one_mask_form(B, Hq, Hkv, T, L, window):
    """A local layer's prefill in blocks of window query rows (windowed_attention, what
    dense_attention does with a window and no positions) equals the whole (T, L) mask's result:
    T below, at and past the window, batches, GQA groups, window 1, queries that are the last T
    of L keys. Every row compared, a right-padded row's tokens included (its padding attends like
    any token: the prefill masks by index)."""
    g = torch.Generator().manual_seed(T * 100 + L)
    D = 32
    q = torch.randn(B, Hq, T, D, generator=g) * 2
    k = torch.randn(B, Hkv, L, D, generator=g) * 2
    v = torch.randn(B, Hkv, L, D, generator=g)
    expected = sliding_window_oracle(q, k, v, window)
    torch.testing.assert_close(dense_attention(q, k, v, window=window), expected, rtol=1e-5, atol=1e-5)
    for block in (1, 3, window, 2 * window + 1):  # any block size gives the same rows
        out = windowed_attention(q, k, v, window, 1 / math.sqrt(D), block=block)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_windowed_prefill_never_builds_a_prompt_squared_mask(monkeypatch):
    """The largest mask and score matrix a windowed prefill builds is (window, 2 window - 1) per
    block, whatever T: at T = 16 windows, 1/8 of the rows and under 1/8 of the columns a (T, T)
    mask would have. Every SDPA call is recorded."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        calls.append((q.shape[-2], k.shape[-2], None if attn_mask is None else attn_mask.numel()))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    window, T = 16, 256
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 1, T, 8), torch.randn(1, 1, T, 8)
    out = dense_attention(q, k, v, window=window)
    assert len(calls) == T // window
    assert max(rows * cols for rows, cols, _ in calls) <= window * (2 * window - 1)
    assert max(mask for _, _, mask in calls) <= window * (2 * window - 1)
    torch.testing.assert_close(out, sliding_window_oracle(q, k, v, window), rtol=1e-5, atol=1e-5)
