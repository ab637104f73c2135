"""decode_attention: the reference equals naive dense softmax attention, and the Triton kernel
equals the reference over ragged lengths, GQA groups, odd head dims, splits, windows and dtypes.

Cache slots past each row's length are poisoned with NaN, and under the interpreter the kernel's
own allocations are too (minikv.kernels.empty), so a slot read that should not be, or an output
element never written, fails loudly instead of passing by luck.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels import load_fused
from minikv.kernels._testing import DEVICE, assert_close, random_tensor
from minikv.kernels.decode_attention import decode_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def decode_cases(draw, dtypes=DTYPES):
    B = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.sampled_from([1, 2, 17, 63, 64, 65, 111]) | st.integers(1, 130), min_size=B, max_size=B))
    return dict(
        B=B, Hkv=draw(st.integers(1, 3)), group=draw(st.integers(1, 4)),
        D=draw(st.sampled_from([16, 32, 60, 64])),
        lengths=lengths, L_cap=max(lengths) + draw(st.integers(0, 40)),  # capacity beyond the longest row
        window=draw(st.none() | st.integers(1, 80)),
        dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)),
        strided_q=draw(st.booleans()),
    )


def make_inputs(case):
    """q (B, Hq, D), k, v (B, Hkv, L_cap, D) with NaN in every slot >= length, lengths (B,)."""
    B, Hkv, D, L = case["B"], case["Hkv"], case["D"], case["L_cap"]
    Hq = Hkv * case["group"]
    dtype, seed = case["dtype"], case["seed"]
    if case["strided_q"]:  # q[:, :, 0] of a (B, Hq, T, D) projection, as the policies pass it
        q = random_tensor((B, Hq, 3, D), dtype, seed)[:, :, 0]
    else:
        q = random_tensor((B, Hq, D), dtype, seed)
    k = random_tensor((B, Hkv, L, D), dtype, seed + 1)
    v = random_tensor((B, Hkv, L, D), dtype, seed + 2)
    lengths = torch.tensor(case["lengths"], device=DEVICE)
    for b, n in enumerate(case["lengths"]):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, lengths


def naive_attention(q, k, v, lengths, window=None):
    """Dense softmax(q k^T / sqrt(D)) v per row and query head, in float64, over the visible slots."""
    q, k, v, lengths = q.cpu(), k.cpu(), v.cpu(), lengths.cpu()
    B, Hq, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    lse = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        lo = max(0, n - window) if window is not None else 0
        for h in range(Hq):
            keys = k[b, h // group, lo:n].double()  # (n - lo, D)
            scores = keys @ q[b, h].double() / math.sqrt(D)  # (n - lo,)
            out[b, h] = torch.softmax(scores, dim=0) @ v[b, h // group, lo:n].double()
            lse[b, h] = torch.logsumexp(scores, dim=0)
    return out, lse


@given(case=decode_cases(dtypes=[torch.float32]))
def test_reference_matches_naive_dense_attention(case):
    q, k, v, lengths = make_inputs(case)
    out, lse = decode_attention(q, k, v, lengths, window=case["window"], return_lse=True)
    expected_out, expected_lse = naive_attention(q, k, v, lengths, case["window"])
    assert_close(out, expected_out, torch.float32, name="reference out")
    assert_close(lse, expected_lse, torch.float32, name="reference lse")


@given(case=decode_cases(), split_len=st.sampled_from([None, 16, 40, 64]), block_n=st.sampled_from([16, 64]))
def test_decode_attention_kernel_matches_reference(case, split_len, block_n):
    """Kernel == reference; split_len forces several splits per row (flash-decoding combine),
    block_n several tiles per split (online softmax), both with partial last tiles."""
    q, k, v, lengths = make_inputs(case)
    expected, expected_lse = decode_attention(q, k, v, lengths, window=case["window"], return_lse=True)
    fused = load_fused("decode_attention")
    out, lse = fused.launch(q, k, v, lengths, window=case["window"], return_lse=True, split_len=split_len, block_n=block_n)
    name = f"{case['dtype']} B={case['B']} Hkv={case['Hkv']} G={case['group']} D={case['D']} lengths={case['lengths']}"
    assert out.dtype == q.dtype
    assert_close(out, expected, name=f"out {name}")
    assert_close(lse, expected_lse, torch.float32, atol=1e-4, rtol=1e-5, name=f"lse {name}")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_dispatch_defaults(backend):
    """Through the public function: default scale 1/sqrt(D), out only unless return_lse."""
    case = dict(B=2, Hkv=3, group=3, D=64, lengths=[5, 111], L_cap=128, window=None,
                dtype=torch.float32, seed=3, strided_q=True)
    q, k, v, lengths = make_inputs(case)
    out = decode_attention(q, k, v, lengths, backend=backend)
    assert_close(out, naive_attention(q, k, v, lengths)[0], torch.float32)
    out2 = decode_attention(q, k, v, lengths, scale=0.5, backend=backend)
    assert not torch.allclose(out, out2)


def test_launcher_rejects_bad_layouts():
    fused = load_fused("decode_attention")
    q, k, v = torch.zeros(1, 4, 16), torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16)
    with pytest.raises(AssertionError, match="multiple of KV heads"):
        fused.decode_attention(q, k, v, torch.tensor([8]))
    with pytest.raises(AssertionError, match="contiguous"):
        fused.decode_attention(q[..., ::2][:, :3], k[..., ::2], v[..., ::2], torch.tensor([8]))
