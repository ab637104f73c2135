"""decode_attention: the reference equals naive dense softmax attention, and the Triton kernel
equals the reference over ragged lengths, GQA groups, odd head dims, splits, windows and dtypes.

The inputs are minikv.testing's (strategies("decode_attention")): cache slots past each row's
length and before its window are poisoned with NaN, and under the interpreter the kernel's own
allocations are too (minikv.kernels.empty), so a slot read that should not be, or an output
element never written, fails loudly instead of passing by luck.
"""
import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels import load_fused
from minikv.kernels.decode_attention import decode_attention
from minikv.testing import Case, assert_close, check, strategies


def naive_attention(q, k, v, lengths, scale=None, window=None):
    """Dense softmax(q k^T * scale) v per row and query head, in float64, over the visible slots."""
    q, k, v, lengths = q.cpu(), k.cpu(), v.cpu(), lengths.cpu()
    B, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = scale if scale is not None else 1 / math.sqrt(D)
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    lse = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        lo = max(0, n - window) if window is not None else 0
        for h in range(Hq):
            keys = k[b, h // group, lo:n].double()  # (n - lo, D)
            scores = keys @ q[b, h].double() * scale  # (n - lo,)
            out[b, h] = torch.softmax(scores, dim=0) @ v[b, h // group, lo:n].double()
            lse[b, h] = torch.logsumexp(scores, dim=0)
    return out, lse


@given(case=strategies("decode_attention", dtypes=[torch.float32]))
def test_reference_matches_naive_dense_attention(case):
    q, k, v, lengths, scale, window, _ = case.inputs()
    out, lse = decode_attention(q, k, v, lengths, scale, window=window, return_lse=True)
    expected_out, expected_lse = naive_attention(q, k, v, lengths, scale, window)
    assert_close(out, expected_out, torch.float32, name="reference out")
    assert_close(lse, expected_lse, torch.float32, name="reference lse")


@given(case=strategies("decode_attention"), split_len=st.sampled_from([None, 16, 40, 64]), block_n=st.sampled_from([16, 64]))
def test_decode_attention_kernel_matches_reference(case, split_len, block_n):
    """Kernel == reference, out and lse; split_len forces several splits per row (flash-decoding
    combine), block_n several tiles per split (online softmax), both with partial last tiles."""
    launch = functools.partial(load_fused("decode_attention").launch, split_len=split_len, block_n=block_n)
    check(case.replace(return_lse=True), launch)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_dispatch_defaults(backend, device):
    """Through the public function: default scale 1/sqrt(D), out only unless return_lse."""
    case = Case("decode_attention", dict(B=2, Hkv=3, group=3, D=64, lengths=[5, 111], L_cap=128, window=None,
                                         scale=None, return_lse=False, dtype=torch.float32, seed=3, strided_q=True), device)
    q, k, v, lengths, *_ = case.inputs()
    out = decode_attention(q, k, v, lengths, backend=backend)
    assert isinstance(out, torch.Tensor)
    assert_close(out, naive_attention(q, k, v, lengths)[0], torch.float32)
    out2 = decode_attention(q, k, v, lengths, scale=0.5, backend=backend)
    assert not torch.allclose(out, out2)


def test_launcher_rejects_bad_layouts(device):
    fused = load_fused("decode_attention")
    q, k, v = (torch.zeros(s, device=device) for s in ((1, 4, 16), (1, 3, 8, 16), (1, 3, 8, 16)))
    lengths = torch.tensor([8], device=device)
    with pytest.raises(AssertionError, match="multiple of KV heads"):
        fused.decode_attention(q, k, v, lengths)
    with pytest.raises(AssertionError, match="contiguous"):
        fused.decode_attention(q[..., ::2][:, :3], k[..., ::2], v[..., ::2], lengths)
