"""bench/shared_prefill.py: the dense attention over a prompt, computed once for several caches."""
import torch

from minikv.bench.shared_prefill import reusing_attention
from minikv.models.attention import dense_attention


def test_reusing_attention_computes_a_repeated_call_once_and_only_a_repeated_one():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with reusing_attention():
        first = dense_attention(q, k, v)
        assert dense_attention(q, k, v) is first  # the same tensors: the first call's output
        other_k = k.clone()  # equal values, another tensor: computed anew
        assert dense_attention(q, other_k, v) is not first
        windowed = dense_attention(q, k, v, window=2)  # another argument: computed anew
        assert not torch.equal(windowed, first)
        k.mul_(2.0)  # changed in place since: computed anew, on the new values
        changed = dense_attention(q, k, v)
        assert changed is not first and not torch.equal(changed, first)
    assert dense_attention(q, k, v) is not changed  # outside the context nothing is kept
    torch.testing.assert_close(dense_attention(q, k, v), changed, rtol=0, atol=0)
