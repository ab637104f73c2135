"""gathered_attention (SyncKV's NR-head attention, Algorithm 1 line 24): the reference equals
dense attention over the gathered rows; the Triton kernel equals the reference over ragged lists
(-1 padding), GQA groups, odd head dims, splits and dtypes. Unlisted slots hold NaN, so a slot
read that should not be fails loudly; under the interpreter the kernel's buffers are NaN too."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels import load_fused
from minikv.kernels._testing import DEVICE, assert_close, random_tensor
from minikv.kernels.gathered_attention import gathered_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def gather_cases(draw, dtypes=DTYPES):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    L_cap = draw(st.sampled_from([1, 17, 63, 100]) | st.integers(1, 130))
    N = draw(st.integers(1, min(L_cap, 70) + 5))
    # per (row, KV head): how many entries are listed (>= 1, <= N and <= L_cap), the rest -1
    listed = draw(st.lists(st.integers(1, min(N, L_cap)), min_size=B * Hkv, max_size=B * Hkv))
    return dict(B=B, Hkv=Hkv, group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 20, 60, 64])),
                L_cap=L_cap, N=N, listed=listed, shuffle_pad=draw(st.booleans()),
                dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    """q (B, Hq, D) strided; k, v (B, Hkv, L_cap, D) with NaN in every unlisted slot; index (B,
    Hkv, N) of distinct slots in random order, -1 padded (at the end, or scattered in between)."""
    B, Hkv, D, L, N = case["B"], case["Hkv"], case["D"], case["L_cap"], case["N"]
    dtype, seed = case["dtype"], case["seed"]
    g = torch.Generator().manual_seed(seed)
    q = random_tensor((B, Hkv * case["group"], 2, D), dtype, seed)[:, :, 1]
    k = random_tensor((B, Hkv, L, D), dtype, seed + 1)
    v = random_tensor((B, Hkv, L, D), dtype, seed + 2)
    index = torch.full((B, Hkv, N), -1, dtype=torch.int64)
    for r, n in enumerate(case["listed"]):
        b, m = divmod(r, Hkv)
        slots = torch.randperm(L, generator=g)[:n]
        row = torch.cat((slots, torch.full((N - n,), -1)))
        if case["shuffle_pad"]:
            row = row[torch.randperm(N, generator=g)]
        index[b, m] = row
        hidden = torch.ones(L, dtype=torch.bool)
        hidden[slots] = False
        k[b, m, hidden.to(DEVICE)] = float("nan")
        v[b, m, hidden.to(DEVICE)] = float("nan")
    return q, k, v, index.to(DEVICE)


def naive(q, k, v, index):
    """Gather each KV head's listed rows, then dense softmax attention per query head, float64."""
    q, k, v, index = q.cpu(), k.cpu(), v.cpu(), index.cpu()
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    lse = torch.empty(B, Hq, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            slots = index[b, h // G]
            slots = slots[slots >= 0]
            scores = k[b, h // G, slots].double() @ q[b, h].double() / math.sqrt(D)
            out[b, h] = torch.softmax(scores, 0) @ v[b, h // G, slots].double()
            lse[b, h] = torch.logsumexp(scores, 0)
    return out, lse


@settings(max_examples=10)
@given(case=gather_cases(dtypes=[torch.float32]))
def test_reference_matches_gather_then_dense_attention(case):
    q, k, v, index = make_inputs(case)
    out, lse = gathered_attention(q, k, v, index, return_lse=True)
    expected, expected_lse = naive(q, k, v, index)
    assert_close(out, expected, torch.float32, name="reference out")
    assert_close(lse, expected_lse, torch.float32, name="reference lse")


@settings(max_examples=8)
@given(case=gather_cases(), split_len=st.sampled_from([None, 16, 48]), block_n=st.sampled_from([16, 32]))
def test_gathered_attention_kernel_matches_reference(case, split_len, block_n):
    """Kernel == reference; split_len forces several splits (some all -1: weight 0 in the merge),
    block_n several tiles per split, partial last tiles included."""
    q, k, v, index = make_inputs(case)
    expected, expected_lse = gathered_attention(q, k, v, index, return_lse=True)
    out, lse = load_fused("gathered_attention").launch(q, k, v, index, return_lse=True, split_len=split_len,
                                                       block_n=block_n)
    name = f"{case['dtype']} B={case['B']} Hkv={case['Hkv']} G={case['group']} D={case['D']} N={case['N']}"
    assert out.dtype == q.dtype
    assert_close(out, expected, name=f"out {name}")
    assert_close(lse, expected_lse, torch.float32, atol=1e-4, rtol=1e-5, name=f"lse {name}")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_dispatch_default_scale_and_int32_index(backend):
    case = dict(B=1, Hkv=3, group=3, D=64, L_cap=50, N=20, listed=[20, 5, 1], shuffle_pad=True,
                dtype=torch.float32, seed=5)
    q, k, v, index = make_inputs(case)
    out = gathered_attention(q, k, v, index.int(), backend=backend)
    assert_close(out, naive(q, k, v, index)[0], torch.float32)
    assert not torch.allclose(out, gathered_attention(q, k, v, index, scale=0.5, backend=backend))


def test_launcher_rejects_bad_layouts():
    fused = load_fused("gathered_attention")
    q, k = torch.zeros(1, 6, 16), torch.zeros(1, 3, 8, 16)
    with pytest.raises(AssertionError, match="index must be"):
        fused.gathered_attention(q, k, k, torch.zeros(1, 2, 4, dtype=torch.int64))
    with pytest.raises(AssertionError, match="index must be"):
        fused.gathered_attention(q, k, k, torch.zeros(1, 3, 4))
