"""gathered_attention (SyncKV's NR-head attention, Algorithm 1 line 24): the reference equals
dense attention over the gathered rows; the Triton kernel equals the reference over ragged lists
(-1 padding), GQA groups, odd head dims, splits and dtypes (minikv.testing's
strategies("gathered_attention")). Unlisted slots hold NaN, so a slot read that should not be
fails loudly; under the interpreter the kernel's buffers are NaN too."""
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels import load_fused
from minikv.kernels.gathered_attention import gathered_attention
from minikv.testing import Case, assert_close, check, strategies


def naive(q, k, v, index, scale=None):
    """Gather each KV head's listed rows, then dense softmax attention per query head, float64."""
    q, k, v, index = q.cpu(), k.cpu(), v.cpu(), index.cpu()
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    scale = scale if scale is not None else 1 / math.sqrt(D)
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    lse = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            slots = index[b, h // G]
            slots = slots[slots >= 0]
            scores = k[b, h // G, slots].double() @ q[b, h].double() * scale
            out[b, h] = torch.softmax(scores, 0) @ v[b, h // G, slots].double()
            lse[b, h] = torch.logsumexp(scores, 0)
    return out, lse


@settings(max_examples=10)
@given(case=strategies("gathered_attention", dtypes=[torch.float32]))
def test_reference_matches_gather_then_dense_attention(case):
    q, k, v, index, scale, _ = case.inputs()
    out, lse = gathered_attention(q, k, v, index, scale, return_lse=True)
    expected, expected_lse = naive(q, k, v, index, scale)
    assert_close(out, expected, torch.float32, name="reference out")
    assert_close(lse, expected_lse, torch.float32, name="reference lse")


@settings(max_examples=8)
@given(case=strategies("gathered_attention"), split_len=st.sampled_from([None, 16, 48]), block_n=st.sampled_from([16, 32]))
def test_gathered_attention_kernel_matches_reference(case, split_len, block_n):
    """Kernel == reference, out and lse; split_len forces several splits (some all -1: weight 0 in
    the merge), block_n several tiles per split, partial last tiles included."""
    launch = functools.partial(load_fused("gathered_attention").launch, split_len=split_len, block_n=block_n)
    check(case.replace(return_lse=True), launch)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_dispatch_default_scale_and_int32_index(backend, device):
    case = Case("gathered_attention", dict(B=1, Hkv=3, group=3, D=64, L_cap=50, N=20, listed=[20, 5, 1], shuffle_pad=True,
                                           scale=None, return_lse=False, dtype=torch.float32, seed=5, strided_q=True), device)
    q, k, v, index, _, _ = case.inputs()
    out = gathered_attention(q, k, v, index.int(), backend=backend)
    assert_close(out, naive(q, k, v, index)[0], torch.float32)
    assert not torch.allclose(out, gathered_attention(q, k, v, index, scale=0.5, backend=backend))


def test_launcher_rejects_bad_layouts(device):
    fused = load_fused("gathered_attention")
    q, k = torch.zeros(1, 6, 16, device=device), torch.zeros(1, 3, 8, 16, device=device)
    with pytest.raises(AssertionError, match="index must be"):
        fused.gathered_attention(q, k, k, torch.zeros(1, 2, 4, dtype=torch.int64, device=device))
    with pytest.raises(AssertionError, match="index must be"):
        fused.gathered_attention(q, k, k, torch.zeros(1, 3, 4, device=device))
