"""dci_scores' stable_topk on rows longer than SORT_BELOW (docs/mutation.md): the test file's shapes
all take the short-row path (one stable sort), so the integer-key path (float_order, the index
tie-break) ran on no row. Here long rows with ties, -0.0 beside 0.0, infinities and neighbouring
floats one ulp apart must give exactly the stable descending sort."""
import pytest
import torch

from minikv.kernels.dci_scores.reference import SORT_BELOW, ranked, stable_topk


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stable_topk_on_long_rows_is_the_stable_descending_sort(seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, float("inf"), float("-inf"), 1e-30, -1e-30])
    pool = torch.cat((pool, torch.nextafter(pool[2:6], torch.tensor(0.0)), torch.randn(6, generator=g)))
    values = pool[torch.randint(len(pool), (2, 3, SORT_BELOW + 77), generator=g)]  # (B, G, C) as ranked's: many ties
    for k in (1, 17, values.shape[-1]):
        expected = values.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(stable_topk(values, k), expected)


def test_ranked_with_k_0_is_an_empty_int64_index():
    """k = 0 (the search's last level: scores only) still returns (B, G, 0) int64 positions."""
    best = ranked(torch.randn(2, 3, 5), 0)
    assert best.shape == (2, 3, 0) and best.dtype == torch.int64
