"""page_gather: the reference gathers exactly the listed blocks, in order, into the front of the
staging buffer and nothing else; the Triton kernel equals it bit for bit (a copy), over dtypes,
odd block shapes, repeated rows and a staging buffer longer than the recall (NaN-poisoned).
Inputs: minikv.testing's strategies("page_gather")."""
import torch
from hypothesis import given

from minikv.kernels import lookup
from minikv.kernels.page_gather import page_gather
from minikv.testing import check, strategies


@given(case=strategies("page_gather"))
def test_kernel_equals_reference(case):
    src, rows, out = case.inputs()
    n = case.params["n"]
    got = page_gather(src, rows, out)
    assert got.shape[0] == n and (n == 0 or got.data_ptr() == out.data_ptr())  # written in place
    assert torch.equal(out[:n], src[rows])  # exactly the listed blocks, in order
    assert out[n:].isnan().all()  # and nothing past them
    check(case, lookup("page_gather", "triton"))  # bit for bit, the buffer past n included
