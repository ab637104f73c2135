"""attention_relevance: the reference equals naive dense attention plus Eq. 2 of the soft-freeze
paper computed head by head, and the Triton kernel equals the reference over ragged lengths, GQA
groups, odd head dims, forced splits and dtypes (minikv.testing's strategies("attention_relevance")).

Cache slots past each row's length are poisoned with NaN, and under the interpreter the kernel's
own allocations are too, so a slot read that should not be, or an output element never written
(an s_j included), fails loudly instead of passing by luck.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels import load_fused
from minikv.kernels.attention_relevance import attention_relevance
from minikv.testing import Case, assert_close, check, strategies


def naive(q, k, v, lengths, scale=None):
    """Per row and query head in float64: softmax(q k^T * scale) v, and Eq. 2 as written,
    s_j = 1/H sum_h |q_h . k_j^(h)| with k^(h) the KV head of h's group; s = 0 past the length."""
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    B, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = scale if scale is not None else 1 / math.sqrt(D)
    lengths = lengths.tolist() if lengths is not None else [k.shape[2]] * B
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    s = torch.zeros(B, k.shape[2], dtype=torch.float64)
    for b, n in enumerate(lengths):
        for h in range(Hq):
            keys = k[b, h // group, :n].double()  # (n, D)
            dots = keys @ q[b, h].double()  # (n,)
            out[b, h] = torch.softmax(dots * scale, dim=0) @ v[b, h // group, :n].double()
            s[b, :n] += dots.abs() / Hq
    return out, s


@given(case=strategies("attention_relevance", dtypes=[torch.float32]))
def test_reference_matches_naive(case):
    q, k, v, lengths, scale = case.inputs()
    out, s = attention_relevance(q, k, v, lengths, scale)
    expected_out, expected_s = naive(q, k, v, lengths, scale)
    assert s.dtype == torch.float32 and s.shape == (case.params["B"], k.shape[2])
    assert_close(out, expected_out, torch.float32, name="reference out")
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5, name="reference s")


@settings(max_examples=12)
@given(case=strategies("attention_relevance"), split_len=st.sampled_from([None, 16, 24, 64]),
       block_n=st.sampled_from([16, 32]))
def test_kernel_matches_reference(case, split_len, block_n):
    """Kernel == reference; split_len forces several splits per row (combine by lse), block_n
    several tiles per split, both with partial last tiles; s is complete per tile."""
    fused = load_fused("attention_relevance")

    def launch(q, k, v, lengths, scale):
        if lengths is None:  # every slot of every row
            lengths = torch.full((k.shape[0],), k.shape[2], device=k.device)
        return fused.launch(q, k, v, lengths, scale, split_len=split_len, block_n=block_n)

    check(case, launch)


def fixed_case(device, **params):
    base = dict(B=1, Hkv=3, group=3, D=64, lengths=[45], L_cap=64, all_slots=False, scale=None,
                dtype=torch.float32, seed=3, strided_q=True)
    return Case("attention_relevance", {**base, **params}, device)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_dispatch_defaults_and_scale(backend, device):
    """Through the public function: default scale 1/sqrt(D); the scale changes out, never s."""
    q, k, v, lengths, _ = fixed_case(device).inputs()
    out, s = attention_relevance(q, k, v, lengths, backend=backend)
    expected_out, expected_s = naive(q, k, v, lengths)
    assert_close(out, expected_out, torch.float32)
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5)
    out2, s2 = attention_relevance(q, k, v, lengths, scale=0.5, backend=backend)
    assert not torch.allclose(out, out2) and torch.equal(s, s2)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_no_lengths_reads_every_slot(backend, device):
    """lengths=None (the caller sliced k and v to the active tokens) is every slot of every row:
    the same results as lengths = L_cap, against the naive computation."""
    q, k, v, lengths, _ = fixed_case(device, B=2, lengths=[37, 37], L_cap=37, seed=5, strided_q=False).inputs()
    out, s = attention_relevance(q, k, v, None, backend=backend)
    expected_out, expected_s = naive(q, k, v, lengths)
    assert_close(out, expected_out, torch.float32)
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip((out, s), attention_relevance(q, k, v, lengths, backend=backend)))


def test_launcher_rejects_bad_layouts(device):
    fused = load_fused("attention_relevance")
    q, k, v = (torch.zeros(s, device=device) for s in ((1, 4, 16), (1, 3, 8, 16), (1, 3, 8, 16)))
    lengths = torch.tensor([8], device=device)
    with pytest.raises(AssertionError, match="multiple of KV heads"):
        fused.attention_relevance(q, k, v, lengths)
    with pytest.raises(AssertionError, match="contiguous"):
        fused.attention_relevance(q[..., ::2][:, :3], k[..., ::2], v[..., ::2], lengths)


@given(rows=st.integers(1, 64), n_sm=st.integers(1, 264), L_cap=st.integers(1, 2**20),
       block_n=st.sampled_from([16, 32, 64]))
def test_split_count_is_capped(rows, n_sm, L_cap, block_n):
    """Both decode kernels size their splits with split_len_for: whole tiles, never more than
    MAX_SPLITS splits (the merge holds every partial of a head in registers), every slot covered."""
    load_fused("attention_relevance")  # selects the interpreter before kernels/_triton.py is imported
    from minikv.kernels._triton import MAX_SPLITS, split_len_for

    split_len = split_len_for(rows, n_sm, L_cap, block_n)
    splits = -(-L_cap // split_len)
    assert split_len % block_n == 0 and 1 <= splits <= MAX_SPLITS
    assert splits * split_len >= L_cap
