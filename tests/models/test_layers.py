"""models/layers.py's Linear: a one-row product split over the CPU threads (one block of output
rows per thread, one torch.bmm) equals F.linear, in both weight layouts, with and without bias;
other inputs take F.linear itself."""
import pytest
import torch
import torch.nn.functional as F

from minikv.loading import matvec_layout
from minikv.models.layers import Linear


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40), (1, 40), (3, 1, 40), (1, 5, 40)])
def test_split_product_equals_linear(threads, n_threads, column_major, bias, shape):
    threads(n_threads)
    g = torch.Generator().manual_seed(0)
    layer = Linear(40, 66, bias=bias)  # 66 rows: 2 and 3 threads split them, 4 would not
    with torch.no_grad():
        layer.weight.copy_(torch.randn(66, 40, generator=g))
        if column_major:
            layer.weight.data = matvec_layout(layer.weight.data)
    x = torch.randn(*shape, generator=g)
    y = layer(x)
    assert y.shape == (*shape[:-1], 66)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_rows_that_do_not_split_evenly_take_linear(threads):
    threads(4)
    layer = Linear(8, 66, bias=True)  # 66 % 4 != 0
    x = torch.randn(1, 1, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
