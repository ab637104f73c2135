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


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_products_on_amx_use_the_packed_weight(rows, bias):
    """bfloat16 on a CPU with AMX: Linear multiplies through oneDNN's prepacked weight, within
    bfloat16's error of a float32 product, and packs again when the weight is replaced. Without
    AMX nothing is packed and the product is F.linear's, bit for bit."""
    from minikv.models.layers import amx_bf16

    torch.manual_seed(rows)
    lin = Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96).bfloat16()
    if not amx_bf16():
        assert lin.amx_packed() is None
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        return
    packed = lin.amx_packed()
    assert packed is not None and packed.is_mkldnn
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    with torch.profiler.profile() as prof:
        got = lin(x)
    assert "mkldnn::_linear_pointwise" in {e.name for e in prof.events()}  # not F.linear
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 80)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
    lin.weight = torch.nn.Parameter(2 * lin.weight.detach())  # replaced: packed anew
    assert lin.amx_packed() is not packed
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), lin.weight.float(),
                                                         None if lin.bias is None else lin.bias.float()),
                               atol=0.1, rtol=0.02)
