"""paged_attention: the oracle is the definition (FlashInfer's): gather the listed pages' tokens
and run dense attention. The reference equals it; the Triton kernel equals the reference over odd
lengths (the last page partial), unused entries, shared and per-head slots, GQA groups, odd head
dims, dtypes and a non-contiguous pool (minikv.testing's strategies("paged_attention")). Pool
tokens that no table entry covers are NaN."""
import math

import torch
from hypothesis import given

from minikv.kernels import lookup
from minikv.kernels.paged_attention import paged_attention
from minikv.testing import Case, assert_close, check, strategies


def gather_dense(q, k_pages, v_pages, table, lens, scale=None):
    """The oracle: gather each KV head's listed tokens, dense softmax attention in float64."""
    q, k_pages, v_pages, table, lens = (t.cpu() for t in (q, k_pages, v_pages, table, lens))
    B, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    scale = scale if scale is not None else 1 / math.sqrt(D)
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for m in range(Hkv):
            idx = [(int(s), t) for s, n in zip(table[b, m], lens[b, m]) for t in range(int(n))]
            keys = torch.stack([k_pages[s, t, m] for s, t in idx]).double()
            vals = torch.stack([v_pages[s, t, m] for s, t in idx]).double()
            for j in range(G):
                p = torch.softmax(keys @ q[b, m * G + j].double() * scale, dim=0)
                out[b, m * G + j] = p @ vals
    return out


@given(case=strategies("paged_attention", dtypes=[torch.float32]))
def test_reference_equals_gather_then_dense_attention(case):
    q, k_pages, v_pages, table, lens, scale, _ = case.inputs()
    out = paged_attention(q, k_pages, v_pages, table, lens, scale)
    assert_close(out, gather_dense(q, k_pages, v_pages, table, lens, scale), torch.float32)


@given(case=strategies("paged_attention"))
def test_kernel_equals_reference(case):
    check(case.replace(return_lse=True), lookup("paged_attention", "triton"))


def test_kernel_equals_gather_dense_on_a_long_partial_table(device):
    """SmolLM2-like shapes: 3 KV heads of 3 query heads, D 64, 9 slots of 32, the last page 17."""
    case = Case("paged_attention", dict(B=1, Hkv=3, G=3, P=32, S=9, N=9, tokens=[8 * 32 + 17] * 3, D=64, scale=None,
                                        return_lse=False, dtype=torch.float32, strided=True, holes=False, seed=3), device)
    q, k_pages, v_pages, _, lens, _, _ = case.inputs()
    table = torch.arange(9, dtype=torch.int32, device=device).expand(1, 3, 9).contiguous()
    k_pages, v_pages = k_pages.nan_to_num(), v_pages.nan_to_num()
    out = paged_attention(q, k_pages, v_pages, table, lens, backend="triton")
    assert_close(out, gather_dense(q, k_pages, v_pages, table, lens), torch.float32)


def test_each_row_is_shifted_by_its_own_maximum():
    """Two KV heads whose scores lie 800 or more apart: a softmax shifted by one maximum over all rows
    (rather than each row's own) underflows the lower row to 0 / 0. Same for the log-sum-exp."""
    D, P = 4, 4
    k_pages = torch.randn(1, P, 2, D, generator=torch.Generator().manual_seed(0))
    v_pages = torch.randn(1, P, 2, D, generator=torch.Generator().manual_seed(1))
    k_pages[:, :, 0] = k_pages[:, :, 0].abs() + 1  # head 0: scores q . k / sqrt(D) >= 400 * D / 2 = 800
    q = torch.stack([torch.full((D,), 400.0), torch.zeros(D)])[None]  # (1, Hq=2, D): head 1 scores 0
    table, lens = torch.zeros(1, 2, 1, dtype=torch.int32), torch.full((1, 2, 1), P, dtype=torch.int32)
    out, lse = paged_attention(q, k_pages, v_pages, table, lens, return_lse=True, backend="reference")
    assert_close(out, gather_dense(q, k_pages, v_pages, table, lens), torch.float32)
    scores = torch.einsum("hd,thd->ht", q[0].double(), k_pages[0].double()) / math.sqrt(D)  # (Hkv, P)
    assert torch.allclose(lse[0].double(), scores.logsumexp(-1), rtol=1e-5)
