"""page_scores: group-consistent selection. The reference against a per-head loop transcription of
the formulas; the Triton kernel selects what the reference selects, ties broken the same way (to
the lower page); the selection does not depend on the order of the heads within a group; -1 pads
rows with fewer candidates than k; NaN in unused pages never leaks. Inputs: minikv.testing's
strategies("page_scores"), boxes (integer ones: exact scores, real ties) and 2-bit codes."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minikv.kernels import lookup
from minikv.kernels.page_scores import pack_codes, page_scores
from minikv.testing import assert_close, check, strategies
from minikv.testing.selection import unpack_codes

boxes = strategies("page_scores").filter(lambda case: not case.params["codes"])
integer_boxes = boxes.map(lambda case: case.replace(integer=True))
codes = strategies("page_scores").filter(lambda case: case.params["codes"])



def loop_reference(q, lo, hi, n_valid, k, scale, reduce):
    """The formulas one head and one page at a time, float64: P_h[n], the group reduction, and a
    stable descending sort."""
    q, lo, hi, n_valid = q.cpu(), lo.cpu(), hi.cpu(), n_valid.cpu()
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


@given(case=boxes)
def test_reference_matches_loop_transcription(case):
    q, lo, hi, n_valid, k, scale, reduce, _ = case.inputs()
    scores, index = page_scores(q, lo, hi, n_valid, k, scale, reduce)
    scores, index = scores.cpu(), index.cpu()
    exp_scores, exp_index = loop_reference(q, lo, hi, n_valid, k, scale, reduce)
    finite = exp_scores > float("-inf")
    assert torch.equal(scores > float("-inf"), finite)
    assert_close(scores[finite], exp_scores[finite].float(), torch.float32, name="scores")
    # the pages picked carry the expected scores (float ties may pick another page of equal score)
    picked = exp_scores.gather(-1, index.clamp_min(0))
    expected = exp_scores.gather(-1, exp_index.clamp_min(0))
    assert torch.equal(index < 0, exp_index < 0)
    assert_close(picked[index >= 0].float(), expected[exp_index >= 0].float(), torch.float32, name="picked scores")


@settings(max_examples=12)
@given(case=integer_boxes)
def test_group_consistent_selection_kernel_equals_reference_ties_included(case):
    """Integer inputs: every score is exact in both, so the indices must match exactly, and the
    duplicated pages make ties that both must break towards the lower page index."""
    check(case, lookup("page_scores", "triton"))


@settings(max_examples=12)
@given(case=boxes)
def test_group_consistent_selection_kernel_equals_reference_float(case):
    check(case, lookup("page_scores", "triton"))


@pytest.mark.parametrize("backend", ["eager", "triton"])
@given(case=integer_boxes, data=st.data())
def test_group_consistent_selection_invariant_to_head_order_within_group(backend, case, data):
    assume(case.params["N"] <= 40)  # small page counts: the interpreter runs this per backend
    q, lo, hi, n_valid, k, _, reduce, _ = case.inputs()
    Hkv, G = case.params["Hkv"], case.params["G"]
    perm = data.draw(st.permutations(range(G)))
    order = torch.tensor([m * G + j for m in range(Hkv) for j in perm], device=q.device)
    a = page_scores(q, lo, hi, n_valid, k, 0.5, reduce, backend=backend)
    b = page_scores(q[:, order], lo, hi, n_valid, k, 0.5, reduce, backend=backend)
    finite = a[0] > float("-inf")
    assert_close(b[0][finite], a[0][finite], torch.float32, name="scores")
    if reduce != "softmax_mean":  # sums and maxima of integer scores: exact in any order
        assert torch.equal(a[1], b[1])
        return
    # the group's softmax shares summed in another order round differently (by up to G ulps of
    # 1), so pages the integer boxes tie exactly may swap places; every other pick is the same
    tol = G * torch.finfo(torch.float32).eps
    for ia, ib, sa in zip(a[1].flatten(0, 1).tolist(), b[1].flatten(0, 1).tolist(), a[0].flatten(0, 1)):
        kth = sa[[p for p in ia if p >= 0][-1]] if ia[0] >= 0 else None
        for p in set(ia) ^ set(ib):
            assert p >= 0 and kth is not None and abs(sa[p] - kth) <= tol, (ia, ib)


def test_every_head_of_a_group_shares_one_selection_and_pads_with_minus_one(device):
    q = torch.randn(1, 6, 8, device=device)
    lo = torch.randn(1, 2, 5, 8, device=device)
    hi = lo + 1
    n = torch.tensor([3], device=device)
    scores, index = page_scores(q, lo, hi, n, 4)
    assert index.shape == (1, 2, 4)  # one row per KV head: the group's query heads share it
    assert index[0, :, 3].tolist() == [-1, -1] and sorted(index[0, 0, :3].tolist()) == [0, 1, 2]
    torch.testing.assert_close(scores[0, :, :3].sum(-1), torch.ones(2, device=device))  # softmax-mean is a distribution
    with pytest.raises(ValueError, match="group_reduce"):
        page_scores(q, lo, hi, n, 2, group_reduce="median")
    with pytest.raises(ValueError, match="k must be"):
        page_scores(q, lo, hi, n, 6)


# -- with 2-bit key codes (freekv's digest=quant2) ------------------------------------------------


@given(case=codes)
def test_codes_stand_for_each_key_within_a_sixth_of_its_box(case, device):
    p = case.params
    g = torch.Generator().manual_seed(p["seed"])
    keys = torch.randn(p["B"], p["Hkv"], p["N"], p["P"], p["D"], generator=g).to(device)
    lo, hi = keys.amin(3), keys.amax(3)
    packed = pack_codes(keys, lo, hi)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (p["D"] + 3) // 4  # 2 bits per channel
    error = (unpack_codes(packed, lo, hi) - keys).abs()
    assert (error <= (hi - lo).unsqueeze(3) / 6 + 1e-6).all()
    levels = torch.randint(0, 4, keys.shape, generator=g).float().to(device)
    grid = lo.unsqueeze(3) + levels * (hi - lo).unsqueeze(3) / 3
    assert torch.allclose(unpack_codes(pack_codes(grid, lo, hi), lo, hi), grid, atol=1e-5)  # on the grid: exact


@given(case=codes)
def test_code_scores_are_the_page_mass_of_the_coded_keys(case):
    """P_h[n] = log sum_t exp(scale q . k^_t) / scale, one head and page at a time in float64."""
    q, lo, hi, n_valid, k, scale, reduce, packed = case.inputs()
    G = case.params["G"]
    scores, _ = page_scores(q, lo, hi, n_valid, k, scale, reduce, packed)
    approx = unpack_codes(packed, lo, hi).double()  # (B, Hkv, N, P, D)
    for b in range(case.params["B"]):
        n = int(n_valid[b])
        for m in range(case.params["Hkv"]):
            if n == 0:
                assert (scores[b, m] == float("-inf")).all()
                continue
            P = torch.stack([torch.logsumexp(scale * approx[b, m, :n] @ q[b, m * G + j].double(), -1) / scale
                             for j in range(G)])  # (G, n)
            s = {"softmax_mean": lambda: torch.softmax(P * scale, 1).mean(0), "mean": lambda: P.mean(0),
                 "max": lambda: P.max(0).values}[reduce]()
            assert_close(scores[b, m, :n], s.float(), torch.float32, name="scores")
            assert (scores[b, m, n:] == float("-inf")).all()


@settings(max_examples=12)
@given(case=codes)
def test_code_scores_kernel_equals_reference(case):
    check(case, lookup("page_scores", "triton"))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_codes_rank_the_page_whose_key_matches_above_a_loose_box(backend, device):
    """Why the codes: page 0 holds one key along q among keys across it; page 1's keys spread over
    every channel, none along q (box bound 7 against page 0's 6). The bound favours page 1's loose box;
    the codes see page 0's key."""
    D, P = 8, 4
    q = torch.zeros(1, 1, D, device=device)
    q[0, 0, :2] = 1.0
    keys = torch.zeros(1, 1, 2, P, D, device=device)
    keys[0, 0, 0, 0, :2] = 3.0  # page 0: one key along q (q . k = 6), the others orthogonal
    keys[0, 0, 0, 1:, 2:] = torch.tensor([[1.0] * 6, [-1.0] * 6, [0.5] * 6])
    keys[0, 0, 1, :, :] = torch.tensor([[3.5, -3.5] + [0.0] * 6, [-3.5, 3.5] + [0.0] * 6,
                                        [3.5, -3.5] + [1.0] * 6, [-3.5, 3.5] + [-1.0] * 6])  # q . k = 0 each
    lo, hi = keys.amin(3), keys.amax(3)
    n = torch.tensor([2], device=device)
    _, bound = page_scores(q, lo, hi, n, 1, 1.0, backend=backend)
    _, coded = page_scores(q, lo, hi, n, 1, 1.0, codes=pack_codes(keys, lo, hi), backend=backend)
    assert bound[0, 0, 0] == 1 and coded[0, 0, 0] == 0


def test_each_heads_softmax_is_shifted_by_its_own_maximum():
    """Two query heads of one group whose page scores lie about 2000 apart: a softmax shifted by
    one maximum over all heads (rather than each head's own) underflows the lower head's share
    to 0, and the group mean loses it."""
    q = torch.tensor([[[1000.0, 1000.0], [0.1, -0.1]]])  # (B=1, Hq=2, D=2): one KV head, G=2
    keys = torch.tensor([[1.0, 1.0], [1.0, 0.5], [0.5, 1.0]])  # (N=3, D): boxes of one key each
    lo = hi = keys[None, None]  # (1, 1, 3, 2)
    n_valid = torch.tensor([3])
    scores, _ = page_scores(q, lo, hi, n_valid, 2, 1.0, "softmax_mean", backend="eager")
    want, _ = loop_reference(q, lo, hi, n_valid, 2, 1.0, "softmax_mean")
    assert_close(scores, want.float(), torch.float32, name="scores")
