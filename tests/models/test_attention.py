"""models/attention.py: a decode step's attention on a CPU in float32 (two batched products)
equals PyTorch's fused SDPA, on GQA groups, batches and a cache read through a slice."""
import pytest
import torch
import torch.nn.functional as F

from minikv.models.attention import dense_attention


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
