"""minikv.fast: the speed layer changes how the model computes, not what. Its linear layers
equal F.linear (a one-row product split over the CPU threads, in either weight layout, with and
without bias; oneDNN's packed product on AMX); a fast model's logits equal the plain model's,
prefill and decode steps, for every family; the plain model stays plain. The speed layer is the
CPU's (threads, oneDNN/AMX, huge pages): every model here is on CPU_ONLY whatever the test device."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import minikv
from minikv import fast
from minikv.fast.linear import FastLinear, FastStackedLinear, amx_bf16, matvec, matvec_layout
from minikv.loading import load_model
from minikv.models.layers import StackedLinear
from minikv.policies import make

from ..fixtures import CPU_ONLY
from ..test_hugepages import mapping_flags, thp_available

MODELS = Path(__file__).resolve().parents[2] / "reference" / "models"
RANDOM = sorted(p.name for p in MODELS.iterdir() if p.name != "smollm2" and (p / "config.json").exists())


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def fast_linear(in_features, out_features, bias, generator=None, dtype=torch.float32):
    plain = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(out_features, in_features, generator=generator))
    return FastLinear.holding(plain)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40), (1, 40), (3, 1, 40), (1, 5, 40)])
def test_split_product_equals_linear(threads, n_threads, column_major, bias, shape):
    threads(n_threads)
    g = torch.Generator().manual_seed(0)
    layer = fast_linear(40, 66, bias, g)  # 66 rows: 2 and 3 threads split them, 4 would not
    if column_major:
        layer.weight.data = matvec_layout(layer.weight.data)
        assert layer.weight.stride() == (1, 66)
    x = torch.randn(*shape, generator=g)
    y = layer(x)
    assert y.shape == (*shape[:-1], 66)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_rows_that_do_not_split_evenly_take_linear(threads):
    threads(4)
    layer = fast_linear(8, 66, bias=True)  # 66 % 4 != 0
    x = torch.randn(1, 1, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_products_on_amx_use_the_packed_weight(rows, bias):
    """bfloat16 on a CPU with AMX: FastLinear multiplies through oneDNN's prepacked weight,
    within bfloat16's error of a float32 product, and packs again when the weight is replaced.
    Without AMX nothing is packed and the product is F.linear's, bit for bit."""
    torch.manual_seed(rows)
    lin = fast_linear(96, 80, bias).to(torch.bfloat16)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_equals_linear(dtype):
    torch.manual_seed(0)
    w, b, x = torch.randn(37, 61, dtype=dtype), torch.randn(37, dtype=dtype), torch.randn(1, 1, 61, dtype=dtype)
    want = F.linear(x.float(), w.float(), b.float())
    got = matvec(x, w, b)
    assert got.shape == (1, 1, 37) and got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0.1)


def decode_logits(model, ids, prefill=7):
    """ids (B, T): prefill the first tokens under the full cache, then one decode step per
    token -> the logits of every position (B, T, V) float32."""
    B, T = ids.shape
    policy = make("full").bind(model.cfg, device=CPU_ONLY, dtype=model.dtype, max_len=T, batch_size=B)
    steps = [model(ids[:, :prefill], policy=policy)]
    for t in range(prefill, T):
        steps.append(model(ids[:, t : t + 1], positions=torch.full((B, 1), t), policy=policy))
    return torch.cat(steps, dim=1)


# float32: the same products summed in another order (column-major, per-thread blocks); bfloat16:
# rounding of the products' outputs to 8 bits of mantissa, logits of order 1-10
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 0.1}


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", RANDOM)
def test_fast_model_equals_plain_model(threads, name, dtype, n_threads):
    """Every family (GQA, q/k/v bias, sliding window, scaled RoPE, partial rotary, parallel
    residual), a batch of rows, prefill then decode steps: the fast model's logits equal the
    plain model's (the one tests/models/test_logits.py pins to transformers')."""
    threads(n_threads)
    plain = load_model(MODELS / name, device=CPU_ONLY, dtype=dtype, fast=False)
    quick = load_model(MODELS / name, device=CPU_ONLY, dtype=dtype)
    assert not any(isinstance(m, FastLinear) for m in plain.modules())
    assert any(isinstance(m, FastLinear) for m in quick.modules())
    ids = load_file(str(MODELS / name / "expected.safetensors"))["input_ids"]
    want, got = decode_logits(plain, ids), decode_logits(quick, ids)
    assert (got - want).abs().max().item() <= TOLERANCE[dtype]


def test_plain_model_has_checkpoint_layout_and_plain_modules():
    """fast=False: the modules of minikv/models with the checkpoint's row-major weights;
    the speed layer, applied afterwards, swaps the linears and keeps ties and state_dict."""
    model = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32, fast=False)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) in (torch.nn.Linear, StackedLinear) for m in linears)
    assert all(p.is_contiguous() for p in model.parameters())
    assert not hasattr(model, "compiled")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fast.apply(model)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, FastStackedLinear)
    assert model.lm_head.weight is model.embed.weight  # still tied
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_compile_needs_the_speed_layer():
    with pytest.raises(ValueError, match="compile=True needs the speed layer"):
        load_model(MODELS / "llama_gqa3", device=CPU_ONLY, compile=True, fast=False)


def test_models_hold_no_speed_machinery():
    """minikv/models is the plain model: no private ops, no compile-time branches, no layouts."""
    src = Path(minikv.__file__).parent / "models"
    text = "\n".join(p.read_text() for p in src.glob("*.py"))
    for needle in ("torch.ops", "is_compiling", "mkldnn", "hugepages", "matvec", "num_threads"):
        assert needle not in text, needle


def test_float32_cpu_matrices_are_stored_column_major():
    loaded = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32)
    linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    half = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.bfloat16)
    assert all(m.weight.is_contiguous() for m in half.modules() if isinstance(m, torch.nn.Linear))
    w = torch.randn(5, 3)
    col = matvec_layout(w)
    assert col.shape == w.shape and col.stride() == (1, 5) and torch.equal(col, w)
    assert matvec_layout(torch.randn(4)).stride() == (1,)


def test_cpu_parameters_are_loaded_into_huge_pages():
    model = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32)
    assert model.cfg.tie_word_embeddings
    ptrs = sorted(p.data_ptr() for p in model.parameters())
    # one mapping for all: the parameters lie within a span not much larger than their bytes
    span = ptrs[-1] - ptrs[0]
    assert span < sum(p.numel() * p.element_size() + 64 for p in model.parameters())
    assert model.lm_head.weight is model.embed.weight  # still tied: copied once
    if thp_available():
        assert "hg" in mapping_flags(ptrs[0])
