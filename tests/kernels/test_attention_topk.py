"""attention_topk (SyncKV's selection, Eqs. 3 and 6 with App. B.1's max-pool): the reference
against a per-head float64 transcription of the formula; the Triton kernel scores what the
reference scores and selects the same tokens (order and ties: descending score, lower token
first); -1 pads rows with fewer candidates than k; excluded (`keep` False) and out-of-range
tokens are never chosen; NaN past n_valid never leaks. Inputs: minikv.testing's
strategies("attention_topk")."""
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels import load_fused, lookup
from minikv.kernels.attention_topk import attention_topk
from minikv.kernels.decode_attention import decode_attention
from minikv.testing import assert_close, check, strategies
from minikv.testing.selection import assert_same_selection


def loop_reference(q, k, lse, n_valid, keep, k_top, scale=None):
    """max over the group of exp(q.k * scale - lse) per token, float64, then a stable sort."""
    q, k, lse = q.cpu().double(), k.cpu().double(), lse.cpu().double()
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = scale if scale is not None else 1 / math.sqrt(D)
    scores = torch.full((B, Hkv, L), float("-inf"), dtype=torch.float64)
    index = torch.full((B, Hkv, k_top), -1)
    for b in range(B):
        for m in range(Hkv):
            for j in range(int(n_valid[b])):
                if keep is not None and not keep[b, m, j]:
                    continue
                scores[b, m, j] = max(math.exp(float(q[b, m * G + g] @ k[b, m, j]) * scale - float(lse[b, m * G + g]))
                                      for g in range(G))
            order = sorted(range(L), key=lambda j: (-scores[b, m, j], j))
            chosen = [j for j in order if scores[b, m, j] > float("-inf")][:k_top]
            index[b, m, :len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
    return scores, index


@settings(max_examples=10)
@given(case=strategies("attention_topk"))
def test_reference_matches_loop_transcription(case):
    q, k, lse, n_valid, keep, k_top, scale = case.inputs()
    scores, index = attention_topk(q, k, lse, n_valid, keep, k_top, scale)
    exp_scores, exp_index = loop_reference(q, k, lse, n_valid, keep, k_top, scale)
    finite = exp_scores > float("-inf")
    assert torch.equal(scores.cpu() > float("-inf"), finite)
    assert_close(scores.cpu()[finite], exp_scores[finite], torch.float32, atol=1e-6, rtol=1e-4)
    assert_same_selection(index, exp_index, exp_scores, tol=1e-6)


@settings(max_examples=8)
@given(case=strategies("attention_topk"))
def test_attention_topk_kernel_matches_reference(case):
    check(case, lookup("attention_topk", "triton"))
    # never an excluded or out-of-range token
    q, k, lse, n_valid, keep, k_top, scale = case.inputs()
    _, index = attention_topk(q, k, lse, n_valid, keep, k_top, scale, backend="triton")
    for b in range(case.params["B"]):
        chosen = index[b][index[b] >= 0]
        assert chosen.numel() == 0 or int(chosen.max()) < case.params["n_valid"][b]
        if keep is not None:
            rows = (index[b] >= 0).nonzero()
            assert bool(keep[b][rows[:, 0], index[b][rows[:, 0], rows[:, 1]]].all())


@settings(max_examples=6)
@given(case=strategies("attention_topk"), max_row=st.sampled_from([16, 32, 64]))
def test_kernel_splits_rows_longer_than_a_tile(case, max_row):
    """A row longer than one register tile (max_row, small here so that the interpreter is quick;
    MAX_ROW on a GPU) is split, its chunks' top k merged: the same selection as the reference."""
    check(case, functools.partial(load_fused("attention_topk").attention_topk, max_row=max_row))


@settings(max_examples=10)
@given(L=st.integers(1, 300), k_top=st.integers(1, 12), max_row=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_split_rows_keep_the_stable_order_exactly(device, L, k_top, max_row, seed):
    """Chunked top-k on scores full of exact ties and -inf, across chunk boundaries: exactly the
    reference's stable order (descending score, the lower token first), -1 for -inf."""
    from minikv.kernels.attention_topk.reference import stable_topk
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (2, 3, L), generator=g).float()
    scores[torch.rand(2, 3, L, generator=g) < 0.3] = float("-inf")
    scores = scores.to(device)
    got = load_fused("attention_topk").row_topk(scores, k_top, max_row)
    assert torch.equal(got.cpu(), stable_topk(scores.cpu(), k_top))


@pytest.mark.slow
def test_kernel_handles_a_row_past_the_real_tile_limit(device):
    """40,000 candidate tokens (SyncKV at a 40k context): more than MAX_ROW = 32,768."""
    fused = load_fused("attention_topk")
    L = fused.MAX_ROW + 7232
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 16, generator=g).to(device)
    k = torch.randn(1, 1, L, 16, generator=g).to(device)
    k[0, 0, L - 3] = q[0, 1] * 4  # the favourite sits in the second chunk
    n = torch.tensor([L], device=device)
    _, lse = decode_attention(q, k, k, n, return_lse=True)
    exp_scores, exp_index = attention_topk(q, k, lse, n, None, 5)
    _, index = fused.attention_topk(q, k, lse, n, None, 5)
    assert int(index[0, 0, 0]) == L - 3
    assert_same_selection(index, exp_index, exp_scores, tol=1e-6)


def test_exact_ties_go_to_the_lower_token(device):
    """Two identical keys: same pooled score, bit for bit; both backends list the lower first."""
    q = torch.randn(1, 2, 16, device=device)
    k = torch.randn(1, 1, 10, 16, device=device)
    k[0, 0, 7] = k[0, 0, 2]
    q[0, :] = k[0, 0, 2] * 3  # make token 2 (and 7) the clear favourite
    n = torch.tensor([10], device=device)
    _, lse = decode_attention(q, k, k, n, return_lse=True)
    for backend in ("eager", "triton"):
        _, index = attention_topk(q, k, lse, n, None, 3, backend=backend)
        assert index[0, 0, :2].tolist() == [2, 7], backend


def test_public_function_rejects_k_top_below_one(device):
    with pytest.raises(ValueError, match="k_top"):
        attention_topk(torch.zeros(1, 1, 4, device=device), torch.zeros(1, 1, 3, 4, device=device),
                       torch.zeros(1, 1, device=device), torch.tensor([3], device=device), None, 0)


def test_exact_ties_in_a_long_selection_keep_token_order(device):
    """48 chosen tokens in two groups of exact ties: each group listed in token order. (torch's
    sort without stable=True reorders equal values in rows longer than 16, on the CPU too.)"""
    g = torch.Generator().manual_seed(0)
    D, L = 16, 64
    k = torch.randn(1, 1, L, D, generator=g)
    # halves of small integers: every q.k of a tied token is exact in float32 whatever the order of
    # the sum, so the ties are exact on every BLAS (a tiled dot may sum rows in different orders)
    a = torch.randint(-3, 4, (D,), generator=g).float() / 2
    k[0, 0, 0::2] = a  # 32 tokens tied at the top
    k[0, 0, 1::4] = a * 0.5  # 16 tokens tied below them
    q = (a * 3)[None, None].repeat(1, 2, 1)  # (1, Hq=2, D): one group of two heads
    k, q, n = k.to(device), q.to(device), torch.tensor([L], device=device)
    _, lse = decode_attention(q, k, k, n, return_lse=True)
    want = list(range(0, L, 2)) + list(range(1, L, 4))
    for backend in ("eager", "triton"):
        _, index = attention_topk(q, k, lse, n, None, 48, backend=backend)
        assert index[0, 0].tolist() == want, backend
