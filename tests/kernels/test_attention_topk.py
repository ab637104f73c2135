"""attention_topk (SyncKV's selection, Eqs. 3 and 6 with App. B.1's max-pool): the reference
against a per-head float64 transcription of the formula; the Triton kernel scores what the
reference scores and selects the same tokens (order and ties: descending score, lower token
first); -1 pads rows with fewer candidates than k; excluded (`keep` False) and out-of-range
tokens are never chosen; NaN past n_valid never leaks."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels import load_fused
from minikv.kernels._testing import DEVICE, assert_close, random_tensor
from minikv.kernels.attention_topk import attention_topk
from minikv.kernels.decode_attention import decode_attention


@st.composite
def topk_cases(draw):
    B, Hkv, L_cap = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 150))
    return dict(B=B, Hkv=Hkv, group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 24, 64])), L_cap=L_cap,
                n_valid=draw(st.lists(st.integers(0, L_cap), min_size=B, max_size=B)),
                k_top=draw(st.integers(1, 40)), keep=draw(st.booleans()), dup=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    """q strided, keys with NaN past n_valid (and copies of earlier keys when `dup`: exact ties),
    lse of each query head over all L_cap + 5 tokens (as SyncKV passes its attention's lse)."""
    B, Hkv, G, D, L = case["B"], case["Hkv"], case["group"], case["D"], case["L_cap"]
    dtype, seed = case["dtype"], case["seed"]
    q = random_tensor((B, Hkv * G, 2, D), dtype, seed)[:, :, 0]
    k_all = random_tensor((B, Hkv, L + 5, D), dtype, seed + 1)
    if case["dup"] and L > 3:
        k_all[:, :, L // 2:L] = k_all[:, :, :L - L // 2].clone()
    _, lse = decode_attention(q, k_all, k_all, torch.full((B,), L + 5, device=DEVICE), return_lse=True)
    k = k_all[:, :, :L].clone()
    for b, n in enumerate(case["n_valid"]):
        k[b, :, n:] = float("nan")
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(B, Hkv, L, generator=g) > 0.3).to(DEVICE) if case["keep"] else None
    return q, k, lse, torch.tensor(case["n_valid"], device=DEVICE), keep


def loop_reference(q, k, lse, n_valid, keep, k_top):
    """max over the group of exp(q.k/sqrt(D) - lse) per token, float64, then a stable sort."""
    q, k, lse = q.cpu().double(), k.cpu().double(), lse.cpu().double()
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scores = torch.full((B, Hkv, L), float("-inf"), dtype=torch.float64)
    index = torch.full((B, Hkv, k_top), -1)
    for b in range(B):
        for m in range(Hkv):
            for j in range(int(n_valid[b])):
                if keep is not None and not keep[b, m, j]:
                    continue
                scores[b, m, j] = max(math.exp(float(q[b, m * G + g] @ k[b, m, j]) / math.sqrt(D) - float(lse[b, m * G + g]))
                                      for g in range(G))
            order = sorted(range(L), key=lambda j: (-scores[b, m, j], j))
            chosen = [j for j in order if scores[b, m, j] > float("-inf")][:k_top]
            index[b, m, :len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
    return scores, index


def assert_same_selection(index, expected_index, expected_scores, tol):
    """Equal lists, except that tokens whose scores differ by less than tol may swap places."""
    for b in range(index.shape[0]):
        for m in range(index.shape[1]):
            got, want = index[b, m].tolist(), expected_index[b, m].tolist()
            assert got.count(-1) == want.count(-1), (b, m, got, want)
            for x, y in zip(got, want):
                if x != y:
                    assert x >= 0 and y >= 0, (b, m, got, want)
                    gap = abs(float(expected_scores[b, m, x]) - float(expected_scores[b, m, y]))
                    assert gap <= tol, f"row {b} head {m}: {got} != {want} (score gap {gap:g})"


@settings(max_examples=10)
@given(case=topk_cases())
def test_reference_matches_loop_transcription(case):
    q, k, lse, n_valid, keep = make_inputs(case)
    scores, index = attention_topk(q, k, lse, n_valid, keep, case["k_top"])
    exp_scores, exp_index = loop_reference(q, k, lse, n_valid, keep, case["k_top"])
    finite = exp_scores > float("-inf")
    assert torch.equal(scores.cpu() > float("-inf"), finite)
    assert_close(scores.cpu()[finite], exp_scores[finite], torch.float32, atol=1e-6, rtol=1e-4)
    assert_same_selection(index.cpu(), exp_index, exp_scores, tol=1e-6)


@settings(max_examples=8)
@given(case=topk_cases())
def test_attention_topk_kernel_matches_reference(case):
    q, k, lse, n_valid, keep = make_inputs(case)
    exp_scores, exp_index = attention_topk(q, k, lse, n_valid, keep, case["k_top"])
    scores, index = attention_topk(q, k, lse, n_valid, keep, case["k_top"], backend="triton")
    finite = exp_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), finite)
    assert_close(scores[finite], exp_scores[finite], torch.float32, atol=1e-6, rtol=1e-4, name="pooled scores")
    assert_same_selection(index.cpu(), exp_index.cpu(), exp_scores.cpu(), tol=1e-6)
    # never an excluded or out-of-range token
    for b in range(case["B"]):
        chosen = index[b][index[b] >= 0]
        assert chosen.numel() == 0 or int(chosen.max()) < case["n_valid"][b]
        if keep is not None:
            rows = (index[b] >= 0).nonzero()
            assert bool(keep[b][rows[:, 0], index[b][rows[:, 0], rows[:, 1]]].all())


@settings(max_examples=6)
@given(case=topk_cases(), max_row=st.sampled_from([16, 32, 64]))
def test_kernel_splits_rows_longer_than_a_tile(case, max_row):
    """A row longer than one register tile (max_row, small here so that the interpreter is quick;
    MAX_ROW on a GPU) is split, its chunks' top k merged: the same selection as the reference."""
    q, k, lse, n_valid, keep = make_inputs(case)
    exp_scores, exp_index = attention_topk(q, k, lse, n_valid, keep, case["k_top"])
    _, index = load_fused("attention_topk").attention_topk(q, k, lse, n_valid, keep, case["k_top"], max_row=max_row)
    assert_same_selection(index.cpu(), exp_index.cpu(), exp_scores.cpu(), tol=1e-6)


@settings(max_examples=10)
@given(L=st.integers(1, 300), k_top=st.integers(1, 12), max_row=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_split_rows_keep_the_stable_order_exactly(L, k_top, max_row, seed):
    """Chunked top-k on scores full of exact ties and -inf, across chunk boundaries: exactly the
    reference's stable order (descending score, the lower token first), -1 for -inf."""
    from minikv.kernels.attention_topk.reference import stable_topk
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (2, 3, L), generator=g).float()
    scores[torch.rand(2, 3, L, generator=g) < 0.3] = float("-inf")
    scores = scores.to(DEVICE)
    got = load_fused("attention_topk").row_topk(scores, k_top, max_row)
    assert torch.equal(got.cpu(), stable_topk(scores.cpu(), k_top))


@pytest.mark.slow
def test_kernel_handles_a_row_past_the_real_tile_limit():
    """40,000 candidate tokens (SyncKV at a 40k context): more than MAX_ROW = 32,768."""
    fused = load_fused("attention_topk")
    L = fused.MAX_ROW + 7232
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 16, generator=g).to(DEVICE)
    k = torch.randn(1, 1, L, 16, generator=g).to(DEVICE)
    k[0, 0, L - 3] = q[0, 1] * 4  # the favourite sits in the second chunk
    _, lse = decode_attention(q, k, k, torch.tensor([L], device=DEVICE), return_lse=True)
    exp_scores, exp_index = attention_topk(q, k, lse, torch.tensor([L], device=DEVICE), None, 5)
    _, index = fused.attention_topk(q, k, lse, torch.tensor([L], device=DEVICE), None, 5)
    assert int(index[0, 0, 0]) == L - 3
    assert_same_selection(index.cpu(), exp_index.cpu(), exp_scores.cpu(), tol=1e-6)


def test_exact_ties_go_to_the_lower_token():
    """Two identical keys: same pooled score, bit for bit; both backends list the lower first."""
    q = torch.randn(1, 2, 16, device=DEVICE)
    k = torch.randn(1, 1, 10, 16, device=DEVICE)
    k[0, 0, 7] = k[0, 0, 2]
    q[0, :] = k[0, 0, 2] * 3  # make token 2 (and 7) the clear favourite
    _, lse = decode_attention(q, k, k, torch.tensor([10], device=DEVICE), return_lse=True)
    for backend in ("eager", "triton"):
        _, index = attention_topk(q, k, lse, torch.tensor([10], device=DEVICE), None, 3, backend=backend)
        assert index[0, 0, :2].tolist() == [2, 7], backend


def test_public_function_rejects_k_top_below_one():
    with pytest.raises(ValueError, match="k_top"):
        attention_topk(torch.zeros(1, 1, 4), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1), torch.tensor([3]), None, 0)
