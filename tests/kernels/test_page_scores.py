"""page_scores: group-consistent selection. The reference against a per-head loop transcription of
the formulas; the Triton kernel selects what the reference selects, ties broken the same way (to
the lower page); the selection does not depend on the order of the heads within a group; -1 pads
rows with fewer candidates than k; NaN in unused pages never leaks."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels._testing import assert_close
from minikv.kernels.page_scores import pack_codes, page_scores, unpack_codes


@st.composite
def score_cases(draw, integer=False, realistic=True):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    # small odd page counts, and (realistic) the ~250 pages of an 8k context in 32-token pages
    N = draw(st.one_of(st.integers(1, 40), st.integers(200, 260)) if realistic else st.integers(1, 40))
    n_valid = draw(st.lists(st.integers(0, N), min_size=B, max_size=B))
    # odd head dims, and the real one (SmolLM2, Llama: 64)
    return dict(B=B, Hkv=Hkv, G=G, N=N, D=draw(st.sampled_from([4, 8, 12, 64])), n_valid=n_valid,
                k=draw(st.integers(1, N)), reduce=draw(st.sampled_from(["softmax_mean", "mean", "max"])),
                integer=integer, dup=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    """q (B, Hq, D) strided, boxes lo <= hi (B, Hkv, N, D) with NaN past n_valid. Integer data
    makes every score exact in float32, so ties are real ties; `dup` copies pages to force them."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, G, N, D = case["B"], case["Hkv"], case["G"], case["N"], case["D"]
    draw = (lambda *s: torch.randint(-3, 4, s, generator=g).float()) if case["integer"] else \
        (lambda *s: torch.randn(*s, generator=g))
    q = draw(B, Hkv * G, 2, D)[:, :, 1]  # a strided view, as the policy passes q[:, :, 0]
    lo = draw(B, Hkv, N, D)
    hi = lo + draw(B, Hkv, N, D).abs()
    if case["dup"] and N > 2:
        lo[:, :, N // 2:] = lo[:, :, :N - N // 2].clone()
        hi[:, :, N // 2:] = hi[:, :, :N - N // 2].clone()
    for b, n in enumerate(case["n_valid"]):
        lo[b, :, n:] = float("nan")
        hi[b, :, n:] = float("nan")
    return q, lo, hi, torch.tensor(case["n_valid"])


def loop_reference(q, lo, hi, n_valid, k, scale, reduce):
    """The formulas one head and one page at a time, float64: P_h[n], the group reduction, and a
    stable descending sort."""
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    scores = torch.full((B, Hkv, N), float("-inf"), dtype=torch.float64)
    index = torch.full((B, Hkv, k), -1)
    for b in range(B):
        n = int(n_valid[b])
        for m in range(Hkv):
            if n == 0:
                continue
            per_head = []
            for j in range(G):
                qh = q[b, m * G + j].double()
                per_head.append(torch.stack([torch.maximum(qh * lo[b, m, p].double(), qh * hi[b, m, p].double()).sum()
                                             for p in range(n)]))
            P = torch.stack(per_head)  # (G, n)
            if reduce == "softmax_mean":
                s = torch.softmax(P * scale, dim=1).mean(0)
            elif reduce == "mean":
                s = P.mean(0)
            else:
                s = P.max(0).values
            scores[b, m, :n] = s
            order = sorted(range(n), key=lambda p: (-float(s[p]), p))[:k]
            index[b, m, :len(order)] = torch.tensor(order)
    return scores, index


@given(case=score_cases())
def test_reference_matches_loop_transcription(case):
    q, lo, hi, n_valid = make_inputs(case)
    scale = 1 / math.sqrt(case["D"])
    scores, index = page_scores(q, lo, hi, n_valid, case["k"], scale, case["reduce"])
    exp_scores, exp_index = loop_reference(q, lo, hi, n_valid, case["k"], scale, case["reduce"])
    finite = exp_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), finite)
    assert_close(scores[finite], exp_scores[finite].float(), torch.float32, name="scores")
    # the pages picked carry the expected scores (float ties may pick another page of equal score)
    picked = exp_scores.gather(-1, index.clamp_min(0))
    expected = exp_scores.gather(-1, exp_index.clamp_min(0))
    assert torch.equal(index < 0, exp_index < 0)
    assert_close(picked[index >= 0].float(), expected[exp_index >= 0].float(), torch.float32, name="picked scores")


@settings(max_examples=12)
@given(case=score_cases(integer=True))
def test_group_consistent_selection_kernel_equals_reference_ties_included(case):
    """Integer inputs: every score is exact in both, so the indices must match exactly, and the
    duplicated pages make ties that both must break towards the lower page index."""
    q, lo, hi, n_valid = make_inputs(case)
    scale = 1 / math.sqrt(case["D"])
    ref_scores, ref_index = page_scores(q, lo, hi, n_valid, case["k"], scale, case["reduce"])
    scores, index = page_scores(q, lo, hi, n_valid, case["k"], scale, case["reduce"], backend="triton")
    assert torch.equal(index, ref_index), f"kernel {index.tolist()} != reference {ref_index.tolist()}"
    finite = ref_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), finite)
    assert_close(scores[finite], ref_scores[finite], torch.float32, name="scores")


@settings(max_examples=12)
@given(case=score_cases())
def test_group_consistent_selection_kernel_equals_reference_float(case):
    q, lo, hi, n_valid = make_inputs(case)
    ref_scores, ref_index = page_scores(q, lo, hi, n_valid, case["k"], 0.3, case["reduce"])
    scores, index = page_scores(q, lo, hi, n_valid, case["k"], 0.3, case["reduce"], backend="triton")
    finite = ref_scores > float("-inf")
    assert_close(scores[finite], ref_scores[finite], torch.float32, name="scores")
    assert torch.equal(index < 0, ref_index < 0)
    # equal up to float near-ties: the reference scores of the picks agree
    assert_close(ref_scores.gather(-1, index.clamp_min(0)), ref_scores.gather(-1, ref_index.clamp_min(0)),
                 torch.float32, name="picked scores")


@pytest.mark.parametrize("backend", ["eager", "triton"])
@given(case=score_cases(integer=True, realistic=False), data=st.data())
def test_group_consistent_selection_invariant_to_head_order_within_group(backend, case, data):
    q, lo, hi, n_valid = make_inputs(case)
    B, Hkv, G = case["B"], case["Hkv"], case["G"]
    perm = data.draw(st.permutations(range(G)))
    order = torch.tensor([m * G + j for m in range(Hkv) for j in perm])
    a = page_scores(q, lo, hi, n_valid, case["k"], 0.5, case["reduce"], backend=backend)
    b = page_scores(q[:, order], lo, hi, n_valid, case["k"], 0.5, case["reduce"], backend=backend)
    assert torch.equal(a[1], b[1])
    finite = a[0] > float("-inf")
    assert_close(b[0][finite], a[0][finite], torch.float32, name="scores")


def test_every_head_of_a_group_shares_one_selection_and_pads_with_minus_one():
    q = torch.randn(1, 6, 8)
    lo = torch.randn(1, 2, 5, 8)
    hi = lo + 1
    scores, index = page_scores(q, lo, hi, torch.tensor([3]), 4)
    assert index.shape == (1, 2, 4)  # one row per KV head: the group's query heads share it
    assert index[0, :, 3].tolist() == [-1, -1] and sorted(index[0, 0, :3].tolist()) == [0, 1, 2]
    torch.testing.assert_close(scores[0, :, :3].sum(-1), torch.ones(2))  # softmax-mean is a distribution
    with pytest.raises(ValueError, match="group_reduce"):
        page_scores(q, lo, hi, torch.tensor([3]), 2, group_reduce="median")
    with pytest.raises(ValueError, match="k must be"):
        page_scores(q, lo, hi, torch.tensor([3]), 6)


# -- with 2-bit key codes (freekv's digest=quant2) ------------------------------------------------


@st.composite
def code_cases(draw):
    """Small shapes (the kernel loops over page tokens and channels in Triton's interpreter)."""
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    N, P, D = draw(st.integers(1, 12)), draw(st.integers(1, 4)), draw(st.sampled_from([3, 4, 8, 12]))
    return dict(B=B, Hkv=Hkv, G=G, N=N, P=P, D=D, n_valid=draw(st.lists(st.integers(0, N), min_size=B, max_size=B)),
                reduce=draw(st.sampled_from(["softmax_mean", "mean", "max"])), seed=draw(st.integers(0, 2**16)))


def code_inputs(case):
    """q, keys (B, Hkv, N, P, D), their min/max boxes, the packed codes; NaN boxes past n_valid."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Hkv, G, N, P, D = (case[x] for x in "B Hkv G N P D".split())
    q = torch.randn(B, Hkv * G, D, generator=g)
    keys = torch.randn(B, Hkv, N, P, D, generator=g)
    lo, hi = keys.amin(3), keys.amax(3)
    codes = pack_codes(keys, lo, hi)
    for b, n in enumerate(case["n_valid"]):
        lo[b, :, n:] = float("nan")
        hi[b, :, n:] = float("nan")
    return q, keys, lo, hi, codes, torch.tensor(case["n_valid"])


@given(case=code_cases())
def test_codes_stand_for_each_key_within_a_sixth_of_its_box(case):
    _, keys, _, _, _, _ = code_inputs(case)
    lo, hi = keys.amin(3), keys.amax(3)
    codes = pack_codes(keys, lo, hi)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (case["D"] + 3) // 4  # 2 bits per channel
    error = (unpack_codes(codes, lo, hi) - keys).abs()
    assert (error <= (hi - lo).unsqueeze(3) / 6 + 1e-6).all()
    grid = lo.unsqueeze(3) + torch.randint(0, 4, keys.shape).float() * (hi - lo).unsqueeze(3) / 3
    assert torch.allclose(unpack_codes(pack_codes(grid, lo, hi), lo, hi), grid, atol=1e-5)  # on the grid: exact


@given(case=code_cases())
def test_code_scores_are_the_page_mass_of_the_coded_keys(case):
    """P_h[n] = log sum_t exp(scale q . k^_t) / scale, one head and page at a time in float64."""
    q, _, lo, hi, codes, n_valid = code_inputs(case)
    G, scale = case["G"], 0.4
    k = case["N"]
    scores, _ = page_scores(q, lo, hi, n_valid, k, scale, case["reduce"], codes)
    approx = unpack_codes(codes, lo, hi).double()  # (B, Hkv, N, P, D)
    for b in range(case["B"]):
        n = int(n_valid[b])
        for m in range(case["Hkv"]):
            if n == 0:
                assert (scores[b, m] == float("-inf")).all()
                continue
            P = torch.stack([torch.logsumexp(scale * approx[b, m, :n] @ q[b, m * G + j].double(), -1) / scale
                             for j in range(G)])  # (G, n)
            s = {"softmax_mean": lambda: torch.softmax(P * scale, 1).mean(0), "mean": lambda: P.mean(0),
                 "max": lambda: P.max(0).values}[case["reduce"]]()
            assert_close(scores[b, m, :n], s.float(), torch.float32, name="scores")
            assert (scores[b, m, n:] == float("-inf")).all()


@settings(max_examples=12)
@given(case=code_cases())
def test_code_scores_kernel_equals_reference(case):
    q, _, lo, hi, codes, n_valid = code_inputs(case)
    k = case["N"]
    ref_scores, ref_index = page_scores(q, lo, hi, n_valid, k, 0.3, case["reduce"], codes)
    scores, index = page_scores(q, lo, hi, n_valid, k, 0.3, case["reduce"], codes, backend="triton")
    finite = ref_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), finite)
    assert_close(scores[finite], ref_scores[finite], torch.float32, name="scores")
    assert torch.equal(index < 0, ref_index < 0)
    assert_close(ref_scores.gather(-1, index.clamp_min(0)), ref_scores.gather(-1, ref_index.clamp_min(0)),
                 torch.float32, name="picked scores")


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_codes_rank_the_page_whose_key_matches_above_a_loose_box(backend):
    """Why the codes: page 0 holds one key along q among keys across it; page 1's keys spread over
    every channel, none along q (box bound 7 against page 0's 6). The bound favours page 1's loose box;
    the codes see page 0's key."""
    D, P = 8, 4
    q = torch.zeros(1, 1, D)
    q[0, 0, :2] = 1.0
    keys = torch.zeros(1, 1, 2, P, D)
    keys[0, 0, 0, 0, :2] = 3.0  # page 0: one key along q (q . k = 6), the others orthogonal
    keys[0, 0, 0, 1:, 2:] = torch.tensor([[1.0] * 6, [-1.0] * 6, [0.5] * 6])
    keys[0, 0, 1, :, :] = torch.tensor([[3.5, -3.5] + [0.0] * 6, [-3.5, 3.5] + [0.0] * 6,
                                        [3.5, -3.5] + [1.0] * 6, [-3.5, 3.5] + [-1.0] * 6])  # q . k = 0 each
    lo, hi = keys.amin(3), keys.amax(3)
    n = torch.tensor([2])
    _, bound = page_scores(q, lo, hi, n, 1, 1.0, backend=backend)
    _, coded = page_scores(q, lo, hi, n, 1, 1.0, codes=pack_codes(keys, lo, hi), backend=backend)
    assert bound[0, 0, 0] == 1 and coded[0, 0, 0] == 0
