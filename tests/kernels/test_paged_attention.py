"""paged_attention: the oracle is the definition (FlashInfer's): gather the listed pages' tokens
and run dense attention. The reference equals it; the Triton kernel equals the reference over odd
lengths (the last page partial), unused entries, shared and per-head slots, GQA groups, odd head
dims, dtypes and a non-contiguous pool. Pool tokens that no table entry covers are NaN."""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels._testing import assert_close, random_tensor
from minikv.kernels.paged_attention import paged_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def paged_cases(draw, dtypes=DTYPES):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    P = draw(st.sampled_from([3, 4, 16, 32]))
    S, N = draw(st.integers(1, 7)), draw(st.integers(1, 5))
    tokens = draw(st.lists(st.integers(1, N * P), min_size=B * Hkv, max_size=B * Hkv))  # odd totals
    return dict(B=B, Hkv=Hkv, G=G, P=P, S=S, N=N, tokens=tokens, D=draw(st.sampled_from([16, 24, 60, 64])),
                dtype=draw(st.sampled_from(dtypes)), strided=draw(st.booleans()),
                holes=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    B, Hkv, G, P, S, N, D = (case[k] for k in ("B", "Hkv", "G", "P", "S", "N", "D"))
    dtype, seed = case["dtype"], case["seed"]
    g = torch.Generator().manual_seed(seed)
    q = random_tensor((B, Hkv * G, D), dtype, seed)
    if case["strided"]:  # a pool viewed out of a wider buffer: non-contiguous slot and token strides
        k_pages = random_tensor((S, P, Hkv + 1, D), dtype, seed + 1)[:, :, 1:]
        v_pages = random_tensor((S + 2, P, Hkv, D), dtype, seed + 2)[1:S + 1]
    else:
        k_pages = random_tensor((S, P, Hkv, D), dtype, seed + 1)
        v_pages = random_tensor((S, P, Hkv, D), dtype, seed + 2)
    table = torch.randint(0, S, (B, Hkv, N), generator=g, dtype=torch.int32)
    lens = torch.zeros(B, Hkv, N, dtype=torch.int32)
    for i, n in enumerate(case["tokens"]):  # n tokens over full pages, the last one partial
        b, m = divmod(i, Hkv)
        full, rest = divmod(n, P)
        lens[b, m, :full] = P
        if rest:
            lens[b, m, full] = rest
        if case["holes"]:  # the same lengths in a shuffled order: unused entries between used ones
            lens[b, m] = lens[b, m, torch.randperm(N, generator=g)]
    # NaN in every pool token no entry reads: a masked token that leaks in fails loudly
    read = torch.zeros(S, P, Hkv, dtype=torch.bool)
    for b in range(B):
        for m in range(Hkv):
            for j in range(N):
                read[table[b, m, j], :lens[b, m, j], m] = True
    k_pages[~read] = float("nan")
    v_pages[~read] = float("nan")
    return q, k_pages, v_pages, table, lens


def gather_dense(q, k_pages, v_pages, table, lens):
    """The oracle: gather each KV head's listed tokens, dense softmax attention in float64."""
    B, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for m in range(Hkv):
            idx = [(int(s), t) for s, n in zip(table[b, m], lens[b, m]) for t in range(int(n))]
            keys = torch.stack([k_pages[s, t, m] for s, t in idx]).double()
            vals = torch.stack([v_pages[s, t, m] for s, t in idx]).double()
            for j in range(G):
                p = torch.softmax(keys @ q[b, m * G + j].double() / math.sqrt(D), dim=0)
                out[b, m * G + j] = p @ vals
    return out


@given(case=paged_cases(dtypes=[torch.float32]))
def test_reference_equals_gather_then_dense_attention(case):
    q, k_pages, v_pages, table, lens = make_inputs(case)
    out = paged_attention(q, k_pages, v_pages, table, lens)
    assert_close(out, gather_dense(q, k_pages, v_pages, table, lens), torch.float32)


@given(case=paged_cases())
def test_kernel_equals_reference(case):
    q, k_pages, v_pages, table, lens = make_inputs(case)
    expected, expected_lse = paged_attention(q, k_pages, v_pages, table, lens, return_lse=True)
    out, lse = paged_attention(q, k_pages, v_pages, table, lens, return_lse=True, backend="triton")
    assert_close(out, expected, case["dtype"])
    assert_close(lse, expected_lse, torch.float32 if case["dtype"] == torch.float32 else case["dtype"], name="lse")


def test_kernel_equals_gather_dense_on_a_long_partial_table():
    """SmolLM2-like shapes: 3 KV heads of 3 query heads, D 64, 9 slots of 32, the last page 17."""
    case = dict(B=1, Hkv=3, G=3, P=32, S=9, N=9, tokens=[8 * 32 + 17] * 3, D=64, dtype=torch.float32,
                strided=True, holes=False, seed=3)
    q, k_pages, v_pages, table, lens = make_inputs(case)
    table = torch.arange(9, dtype=torch.int32).expand(1, 3, 9).contiguous()
    out = paged_attention(q, k_pages.nan_to_num(), v_pages.nan_to_num(), table, lens, backend="triton")
    assert_close(out, gather_dense(q, k_pages.nan_to_num(), v_pages.nan_to_num(), table, lens), torch.float32)
