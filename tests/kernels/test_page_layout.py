"""page_layout: HND host blocks -> NHD device pool. The reference writes exactly block i into
(slots[i], heads[i]) and nothing else; the kernel equals the reference bit for bit; HND -> NHD
undoes NHD -> HND (the offload direction)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels._testing import random_tensor
from minikv.kernels.page_layout import hnd_to_nhd, nhd_to_hnd


@st.composite
def layout_cases(draw):
    S, Hkv = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    pairs = draw(st.lists(st.tuples(st.integers(0, S - 1), st.integers(0, Hkv - 1)), unique=True, max_size=S * Hkv))
    return dict(S=S, Hkv=Hkv, P=draw(st.sampled_from([3, 4, 32])), D=draw(st.sampled_from([8, 60, 64])),
                pairs=pairs, dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def make_inputs(case):
    n = len(case["pairs"])
    blocks = random_tensor((n, 2, case["P"], case["D"]), case["dtype"], case["seed"])
    pool_shape = (case["S"], case["P"], case["Hkv"], case["D"])
    if case["strided"]:  # the pool as a view with a wider head stride
        k = torch.full(pool_shape[:2] + (case["Hkv"] + 1, case["D"]), float("nan"), dtype=case["dtype"])[:, :, :-1]
    else:
        k = torch.full(pool_shape, float("nan"), dtype=case["dtype"])
    v = torch.full(pool_shape, float("nan"), dtype=case["dtype"])
    slots = torch.tensor([s for s, _ in case["pairs"]], dtype=torch.int64)
    heads = torch.tensor([h for _, h in case["pairs"]], dtype=torch.int32)
    return blocks, k, v, slots, heads


@given(case=layout_cases())
def test_reference_writes_each_block_to_its_slot_and_head_only(case):
    blocks, k, v, slots, heads = make_inputs(case)
    hnd_to_nhd(blocks, k, v, slots, heads)
    written = torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool)
    for i, (s, h) in enumerate(case["pairs"]):
        assert torch.equal(k[s, :, h], blocks[i, 0]) and torch.equal(v[s, :, h], blocks[i, 1])
        written[s, h] = True
    assert k.permute(0, 2, 1, 3)[~written].isnan().all() and v.permute(0, 2, 1, 3)[~written].isnan().all()


@given(case=layout_cases())
def test_kernel_equals_reference_bit_for_bit(case):
    blocks, k, v, slots, heads = make_inputs(case)
    k2, v2 = k.clone(), v.clone()
    hnd_to_nhd(blocks, k, v, slots, heads)
    hnd_to_nhd(blocks, k2, v2, slots, heads, backend="triton")
    assert torch.equal(k.nan_to_num(7.0), k2.nan_to_num(7.0)) and torch.equal(v.nan_to_num(7.0), v2.nan_to_num(7.0))


def test_hnd_to_nhd_undoes_nhd_to_hnd():
    k, v = torch.randn(5, 4, 3, 8), torch.randn(5, 4, 3, 8)  # (n, P, Hkv, D)
    blocks = nhd_to_hnd(k, v)  # (n, Hkv, 2, P, D)
    assert blocks.shape == (5, 3, 2, 4, 8) and blocks.is_contiguous()
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    slots = torch.arange(5).repeat_interleave(3)
    heads = torch.arange(3).repeat(5)
    hnd_to_nhd(blocks.reshape(15, 2, 4, 8), k2, v2, slots, heads, backend="triton")
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_kernel_rejects_strided_slot_and_head_indices():
    # regression: columns of one (n, 3) tensor are strided views; the kernel reads slots[i] at
    # slots_ptr + i, so it once scattered blocks into wrong slots (out of bounds, under the
    # interpreter a heap corruption). The launcher must refuse them, and the policy pass columns.
    import pytest

    blocks = torch.randn(2, 2, 4, 8)
    k_pages, v_pages = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    moves = torch.tensor([[7, 0, 1], [9, 2, 0]])  # (host row, slot, head) per block
    slots, heads = moves[:, 1], moves[:, 2]
    assert not slots.is_contiguous()
    with pytest.raises(AssertionError, match="contiguous"):
        hnd_to_nhd(blocks, k_pages, v_pages, slots, heads, backend="triton")
    hnd_to_nhd(blocks, k_pages, v_pages, slots.contiguous(), heads.contiguous(), backend="triton")
    torch.testing.assert_close(k_pages[2, :, 0], blocks[1, 0], rtol=0, atol=0)
    torch.testing.assert_close(v_pages[0, :, 1], blocks[0, 1], rtol=0, atol=0)
