"""dci_scores: the reference equals its definition (score every listed key of the row's head by
q . k, then a stable descending sort), and the Triton kernel equals the reference over odd head
dims, ragged candidate lists (padding between rows of different counts), repeated ids, ties,
several KV heads and k up to C."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels._testing import DEVICE, assert_close, random_tensor
from minikv.kernels.dci_scores import dci_scores
from minikv.kernels.dci_scores.reference import stable_topk


@st.composite
def dci_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    R, H, N = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    C = draw(st.integers(1, 37))
    return dict(R=R, H=H, N=N, C=C, D=draw(st.sampled_from([8, 24, 60, 64])), k=draw(st.integers(1, C)),
                dtype=draw(st.sampled_from(dtypes)), ties=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    R, H, N, C, D = (case[x] for x in ("R", "H", "N", "C", "D"))
    g = torch.Generator().manual_seed(case["seed"])
    keys = random_tensor((H, N, D), case["dtype"], case["seed"])
    if case["ties"]:  # few distinct keys: equal scores, ordered by position
        keys = keys[:, torch.randint(0, min(3, N), (N,), generator=g)].contiguous()
    q = random_tensor((R, D), case["dtype"], case["seed"] + 1)
    heads = torch.randint(0, H, (R,), generator=g).to(DEVICE)
    cand = torch.randint(0, N, (R, C), generator=g)
    counts = torch.randint(0, C + 1, (R,), generator=g)
    cand[torch.arange(C)[None] >= counts[:, None]] = -1  # ragged rows, padded at the end
    return q, keys, heads, cand.to(DEVICE), counts


def test_stable_topk_is_a_stable_descending_sort():
    g = torch.Generator().manual_seed(0)
    v = torch.randint(-3, 3, (5, 50), generator=g).float()
    v[0, 10:20] = float("-inf")
    v[1, -1] = -0.0  # -0.0 and 0.0 compare equal
    expected = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :17]
    assert torch.equal(stable_topk(v, 17), expected)


@given(case=dci_cases(dtypes=(torch.float32,)))
def test_reference_equals_definition(case):
    q, keys, heads, cand, counts = make_inputs(case)
    scores, best = dci_scores(q, keys, heads, cand, case["k"])
    R, C = cand.shape
    for r in range(R):
        h = int(heads[r])
        for j in range(C):
            c = int(cand[r, j])
            want = float("-inf") if c < 0 else float(keys[h, c].double() @ q[r].double())
            assert (scores[r, j] == want) if c < 0 else abs(float(scores[r, j]) - want) <= 1e-4 * (1 + abs(want))
        order = torch.sort(scores[r], descending=True, stable=True).indices[:case["k"]]
        order[scores[r, order] == float("-inf")] = -1
        assert best[r].tolist() == order.tolist()
        assert (best[r] >= 0).sum() == min(case["k"], int(counts[r]))


@given(case=dci_cases())
def test_kernel_equals_reference(case):
    q, keys, heads, cand, _ = make_inputs(case)
    ref_scores, ref_best = dci_scores(q, keys, heads, cand, case["k"])
    scores, best = dci_scores(q, keys, heads, cand, case["k"], backend="triton")
    valid = cand >= 0
    assert torch.equal(scores == float("-inf"), ~valid)  # padding is -inf, nothing else
    assert_close(scores[valid], ref_scores[valid], torch.float32, atol=1e-4, rtol=1e-4, name="scores")
    # the picks: exactly a stable descending order of the kernel's own scores (ties to the lower
    # position), and the same scores the reference picked
    expected = stable_topk(scores.cpu(), case["k"])
    expected[scores.cpu().gather(1, expected) == float("-inf")] = -1
    assert torch.equal(best.cpu(), expected)
    assert torch.equal(best >= 0, ref_best >= 0)
    picked = best >= 0
    assert_close(scores.gather(1, best.clamp_min(0))[picked], ref_scores.gather(1, ref_best.clamp_min(0))[picked],
                 torch.float32, atol=1e-4, rtol=1e-4, name="picked scores")
