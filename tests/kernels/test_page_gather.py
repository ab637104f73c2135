"""page_gather: the reference gathers exactly the listed blocks, in order, into the front of the
staging buffer and nothing else; the Triton kernel equals it bit for bit (a copy), over dtypes,
odd block shapes, repeated rows and a staging buffer longer than the recall (NaN-poisoned)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels._testing import DEVICE, random_tensor
from minikv.kernels.page_gather import page_gather


@st.composite
def gather_cases(draw):
    return dict(M=draw(st.integers(1, 12)), n=draw(st.integers(0, 9)), P=draw(st.sampled_from([1, 3, 16])),
                D=draw(st.sampled_from([4, 24, 64])), spare=draw(st.integers(0, 3)),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                seed=draw(st.integers(0, 2**16)))


@given(case=gather_cases())
def test_kernel_equals_reference(case):
    M, n, P, D, dtype = case["M"], case["n"], case["P"], case["D"], case["dtype"]
    src = random_tensor((M, 2, P, D), dtype, case["seed"])  # host pages viewed as (pages * Hkv, 2, P, D)
    rows = torch.randint(0, M, (n,), generator=torch.Generator().manual_seed(case["seed"])).to(DEVICE)
    outs = {}
    for backend in ("eager", "triton"):
        out = torch.full((n + case["spare"], 2, P, D), float("nan"), dtype=dtype, device=DEVICE)
        got = page_gather(src, rows, out, backend=backend)
        assert got.shape[0] == n and (n == 0 or got.data_ptr() == out.data_ptr())  # written in place
        assert torch.equal(out[:n], src[rows])  # exactly the listed blocks, in order
        assert out[n:].isnan().all()  # and nothing past them
        outs[backend] = out[:n]
    assert torch.equal(outs["triton"], outs["eager"])
