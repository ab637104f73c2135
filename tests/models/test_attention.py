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
