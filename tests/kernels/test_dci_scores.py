"""dci_scores: the reference equals its definition (each query of a block scores the shared
candidates its mask selects by q . k in its block's head, then a stable descending sort), and
the Triton kernel equals the reference over odd head dims, ragged candidate lists (padding between
blocks of different counts), masks, repeated ids, ties, several KV heads and k up to C
(minikv.testing's strategies("dci_scores"); keys no block lists are NaN)."""
import pytest
import torch
from hypothesis import given, settings

from minikv.kernels import lookup
from minikv.kernels.dci_scores import dci_scores
from minikv.kernels.dci_scores.reference import stable_topk
from minikv.testing import check, strategies


@pytest.mark.parametrize("n", [50, 5000])  # a short row is sorted, a long one ranked by integer keys
def test_stable_topk_is_a_stable_descending_sort(n, device):
    g = torch.Generator().manual_seed(0)
    v = torch.randint(-3, 3, (5, n), generator=g).float()
    v[0, 10:20] = float("-inf")
    v[1, -1] = v[1, 0] = -0.0  # equal to 0.0: a tie like any other
    v[2, 5] = 0.0
    expected = torch.sort(v, dim=1, descending=True, stable=True).indices[:, :17]
    assert torch.equal(stable_topk(v.to(device), 17).cpu(), expected)


@given(case=strategies("dci_scores", dtypes=[torch.float32]))
def test_reference_equals_definition(case):
    q, keys, heads, cand, mask, k = case.inputs()
    scores, best = dci_scores(q, keys, heads, cand, mask, k)
    q, keys, heads, cand, mask, scores, best = (t.cpu() for t in (q, keys, heads, cand, mask, scores, best))
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
            order = torch.sort(scores[b, g], descending=True, stable=True).indices[:k]
            order[scores[b, g, order] == float("-inf")] = -1
            assert best[b, g].tolist() == order.tolist()


@settings(max_examples=10)  # the interpreter runs k passes per query: keep it under a minute
@given(case=strategies("dci_scores"))
def test_kernel_equals_reference(case):
    """-inf exactly where not scored; the picks exactly a stable descending order of the
    kernel's own scores (ties to the lower position), carrying the scores the reference picked."""
    check(case, lookup("dci_scores", "triton"))
