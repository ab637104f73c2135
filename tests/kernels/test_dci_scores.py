"""dci_scores: the reference equals its definition (each query of a block scores the shared
candidates its mask selects by q . k in its block's head, then a stable descending sort), and
the Triton kernel equals the reference over odd head dims, ragged candidate lists (padding between
blocks of different counts), masks, repeated ids, ties, several KV heads and k up to C."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.kernels._testing import DEVICE, assert_close, random_tensor
from minikv.kernels.dci_scores import dci_scores
from minikv.kernels.dci_scores.reference import stable_topk


@st.composite
def dci_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    B, G, H, N = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    C = draw(st.integers(1, 37))
    return dict(B=B, G=G, H=H, N=N, C=C, D=draw(st.sampled_from([8, 24, 60, 64])), k=draw(st.integers(0, C)),  # 0: scores only
                dtype=draw(st.sampled_from(dtypes)), ties=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    B, G, H, N, C, D = (case[x] for x in ("B", "G", "H", "N", "C", "D"))
    g = torch.Generator().manual_seed(case["seed"])
    keys = random_tensor((H, N, D), case["dtype"], case["seed"])
    if case["ties"]:  # few distinct keys: equal scores, ordered by position
        keys = keys[:, torch.randint(0, min(3, N), (N,), generator=g)].contiguous()
    q = random_tensor((B, G, D), case["dtype"], case["seed"] + 1)
    heads = torch.randint(0, H, (B,), generator=g).to(DEVICE)
    cand = torch.randint(0, N, (B, C), generator=g)
    counts = torch.randint(0, C + 1, (B,), generator=g)
    cand[torch.arange(C)[None] >= counts[:, None]] = -1  # ragged blocks, padded at the end
    mask = torch.rand(B, G, C, generator=g) < 0.7
    return q, keys, heads, cand.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("n", [50, 5000])  # a short row is sorted, a long one ranked by integer keys
def test_stable_topk_is_a_stable_descending_sort(n):
    g = torch.Generator().manual_seed(0)
    v = torch.randint(-3, 3, (5, n), generator=g).float()
    v[0, 10:20] = float("-inf")
    v[1, -1] = v[1, 0] = -0.0  # equal to 0.0: a tie like any other
    v[2, 5] = 0.0
    expected = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :17]
    assert torch.equal(stable_topk(v, 17), expected)


@given(case=dci_cases(dtypes=(torch.float32,)))
def test_reference_equals_definition(case):
    q, keys, heads, cand, mask = make_inputs(case)
    scores, best = dci_scores(q, keys, heads, cand, mask, case["k"])
    B, G, C = mask.shape
    for b in range(B):
        h = int(heads[b])
        for g in range(G):
            for j in range(C):
                c = int(cand[b, j])
                if c < 0 or not mask[b, g, j]:
                    assert scores[b, g, j] == float("-inf")
                else:
                    want = float(keys[h, c].double() @ q[b, g].double())
                    assert abs(float(scores[b, g, j]) - want) <= 1e-4 * (1 + abs(want))
            order = torch.sort(scores[b, g], descending=True, stable=True).indices[:case["k"]]
            order[scores[b, g, order] == float("-inf")] = -1
            assert best[b, g].tolist() == order.tolist()


@settings(max_examples=10)  # the interpreter runs k passes per query: keep it under a minute
@given(case=dci_cases())
def test_kernel_equals_reference(case):
    q, keys, heads, cand, mask = make_inputs(case)
    ref_scores, ref_best = dci_scores(q, keys, heads, cand, mask, case["k"])
    scores, best = dci_scores(q, keys, heads, cand, mask, case["k"], backend="triton")
    scored = mask & (cand >= 0)[:, None]
    assert torch.equal(scores == float("-inf"), ~scored)  # -inf exactly where not scored
    assert_close(scores[scored], ref_scores[scored], torch.float32, atol=1e-4, rtol=1e-4, name="scores")
    # the picks: exactly a stable descending order of the kernel's own scores (ties to the lower
    # position), and the same scores the reference picked
    expected = stable_topk(scores.cpu(), case["k"])
    expected[scores.cpu().gather(2, expected) == float("-inf")] = -1
    assert torch.equal(best.cpu(), expected)
    assert torch.equal(best >= 0, ref_best >= 0)
    picked = best >= 0
    assert_close(scores.gather(2, best.clamp_min(0))[picked], ref_scores.gather(2, ref_best.clamp_min(0))[picked],
                 torch.float32, atol=1e-4, rtol=1e-4, name="picked scores")
