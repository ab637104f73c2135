"""attention_relevance: the reference equals naive dense attention plus Eq. 2 of the soft-freeze
paper computed head by head, and the Triton kernel equals the reference over ragged lengths, GQA
groups, odd head dims, forced splits and dtypes.

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
from minikv.kernels._testing import assert_close, random_tensor
from minikv.kernels.attention_relevance import attention_relevance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def cases(draw, dtypes=DTYPES):
    B = draw(st.integers(1, 2))
    lengths = draw(st.lists(st.sampled_from([1, 2, 17, 31, 33, 63]) | st.integers(1, 70), min_size=B, max_size=B))
    return dict(
        B=B, Hkv=draw(st.integers(1, 3)), group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 32, 60, 64])),
        lengths=lengths, L_cap=max(lengths) + draw(st.integers(0, 40)),  # capacity beyond the longest row
        dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)), strided_q=draw(st.booleans()),
    )


def make_inputs(case):
    """q (B, Hq, D), k, v (B, Hkv, L_cap, D) with NaN in every slot >= length, lengths (B,)."""
    B, Hkv, D, L, dtype, seed = case["B"], case["Hkv"], case["D"], case["L_cap"], case["dtype"], case["seed"]
    Hq = Hkv * case["group"]
    if case["strided_q"]:  # q[:, :, 0] of a (B, Hq, T, D) projection, as the policies pass it
        q = random_tensor((B, Hq, 3, D), dtype, seed)[:, :, 0]
    else:
        q = random_tensor((B, Hq, D), dtype, seed)
    k = random_tensor((B, Hkv, L, D), dtype, seed + 1)
    v = random_tensor((B, Hkv, L, D), dtype, seed + 2)
    for b, n in enumerate(case["lengths"]):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, torch.tensor(case["lengths"])


def naive(q, k, v, lengths):
    """Per row and query head in float64: softmax(q k^T / sqrt(D)) v, and Eq. 2 as written,
    s_j = 1/H sum_h |q_h . k_j^(h)| with k^(h) the KV head of h's group; s = 0 past the length."""
    B, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    s = torch.zeros(B, k.shape[2], dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hq):
            keys = k[b, h // group, :n].double()  # (n, D)
            dots = keys @ q[b, h].double()  # (n,)
            out[b, h] = torch.softmax(dots / math.sqrt(D), dim=0) @ v[b, h // group, :n].double()
            s[b, :n] += dots.abs() / Hq
    return out, s


@given(case=cases(dtypes=[torch.float32]))
def test_reference_matches_naive(case):
    q, k, v, lengths = make_inputs(case)
    out, s = attention_relevance(q, k, v, lengths)
    expected_out, expected_s = naive(q, k, v, lengths)
    assert s.dtype == torch.float32 and s.shape == (case["B"], case["L_cap"])
    assert_close(out, expected_out, torch.float32, name="reference out")
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5, name="reference s")


@settings(max_examples=12)
@given(case=cases(), split_len=st.sampled_from([None, 16, 24, 64]), block_n=st.sampled_from([16, 32]))
def test_kernel_matches_reference(case, split_len, block_n):
    """Kernel == reference; split_len forces several splits per row (combine by lse), block_n
    several tiles per split, both with partial last tiles; s is complete per tile."""
    q, k, v, lengths = make_inputs(case)
    expected_out, expected_s = attention_relevance(q, k, v, lengths)
    out, s = load_fused("attention_relevance").launch(q, k, v, lengths, split_len=split_len, block_n=block_n)
    name = f"{case['dtype']} B={case['B']} Hkv={case['Hkv']} G={case['group']} D={case['D']} lengths={case['lengths']}"
    assert out.dtype == q.dtype
    assert_close(out, expected_out, name=f"out {name}")
    # s: float32 sums of the same products (exact for 16-bit inputs) in another order
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5, name=f"s {name}")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_dispatch_defaults_and_scale(backend):
    """Through the public function: default scale 1/sqrt(D); the scale changes out, never s."""
    case = dict(B=1, Hkv=3, group=3, D=64, lengths=[45], L_cap=64, dtype=torch.float32, seed=3, strided_q=True)
    q, k, v, lengths = make_inputs(case)
    out, s = attention_relevance(q, k, v, lengths, backend=backend)
    expected_out, expected_s = naive(q, k, v, lengths)
    assert_close(out, expected_out, torch.float32)
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5)
    out2, s2 = attention_relevance(q, k, v, lengths, scale=0.5, backend=backend)
    assert not torch.allclose(out, out2) and torch.equal(s, s2)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_no_lengths_reads_every_slot(backend):
    """lengths=None (the caller sliced k and v to the active tokens) is every slot of every row:
    the same results as lengths = L_cap, against the naive computation."""
    case = dict(B=2, Hkv=3, group=3, D=64, lengths=[37, 37], L_cap=37, dtype=torch.float32, seed=5, strided_q=False)
    q, k, v, lengths = make_inputs(case)
    out, s = attention_relevance(q, k, v, None, backend=backend)
    expected_out, expected_s = naive(q, k, v, lengths)
    assert_close(out, expected_out, torch.float32)
    assert_close(s, expected_s, torch.float32, atol=1e-4, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip((out, s), attention_relevance(q, k, v, lengths, backend=backend)))


def test_launcher_rejects_bad_layouts():
    fused = load_fused("attention_relevance")
    q, k, v = torch.zeros(1, 4, 16), torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16)
    with pytest.raises(AssertionError, match="multiple of KV heads"):
        fused.attention_relevance(q, k, v, torch.tensor([8]))
    with pytest.raises(AssertionError, match="contiguous"):
        fused.attention_relevance(q[..., ::2][:, :3], k[..., ::2], v[..., ::2], torch.tensor([8]))


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
