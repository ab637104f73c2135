"""page_layout: HND host blocks -> NHD device pool. The reference writes exactly block i into
(slots[i], heads[i]) and nothing else; the kernel equals the reference bit for bit; HND -> NHD
undoes NHD -> HND (the offload direction). Inputs: minikv.testing's strategies("page_layout")."""
import pytest
import torch
from hypothesis import given

from minikv.kernels import lookup
from minikv.kernels.page_layout import hnd_to_nhd, nhd_to_hnd
from minikv.testing import check, strategies


@given(case=strategies("page_layout"))
def test_reference_writes_each_block_to_its_slot_and_head_only(case):
    blocks, k, v, slots, heads = case.inputs()
    hnd_to_nhd(blocks, k, v, slots, heads)
    written = torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    for i, (s, h) in enumerate(case.params["pairs"]):
        assert torch.equal(k[s, :, h], blocks[i, 0]) and torch.equal(v[s, :, h], blocks[i, 1])
        written[s, h] = True
    assert k.permute(0, 2, 1, 3)[~written].isnan().all() and v.permute(0, 2, 1, 3)[~written].isnan().all()


@given(case=strategies("page_layout"))
def test_kernel_equals_reference_bit_for_bit(case):
    check(case, lookup("page_layout", "triton"))


def test_hnd_to_nhd_undoes_nhd_to_hnd(device):
    k, v = torch.randn(5, 4, 3, 8, device=device), torch.randn(5, 4, 3, 8, device=device)  # (n, P, Hkv, D)
    blocks = nhd_to_hnd(k, v)  # (n, Hkv, 2, P, D)
    assert blocks.shape == (5, 3, 2, 4, 8) and blocks.is_contiguous()
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    slots = torch.arange(5, device=device).repeat_interleave(3)
    heads = torch.arange(3, device=device).repeat(5)
    hnd_to_nhd(blocks.reshape(15, 2, 4, 8), k2, v2, slots, heads, backend="triton")
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_kernel_rejects_strided_slot_and_head_indices(device):
    # regression: columns of one (n, 3) tensor are strided views; the kernel reads slots[i] at
    # slots_ptr + i, so it once scattered blocks into wrong slots (out of bounds, under the
    # interpreter a heap corruption). The launcher must refuse them, and the policy pass columns.
    blocks = torch.randn(2, 2, 4, 8, device=device)
    k_pages, v_pages = torch.zeros(3, 4, 2, 8, device=device), torch.zeros(3, 4, 2, 8, device=device)
    moves = torch.tensor([[7, 0, 1], [9, 2, 0]], device=device)  # (host row, slot, head) per block
    slots, heads = moves[:, 1], moves[:, 2]
    assert not slots.is_contiguous()
    with pytest.raises(AssertionError, match="contiguous"):
        hnd_to_nhd(blocks, k_pages, v_pages, slots, heads, backend="triton")
    hnd_to_nhd(blocks, k_pages, v_pages, slots.contiguous(), heads.contiguous(), backend="triton")
    torch.testing.assert_close(k_pages[2, :, 0], blocks[1, 0], rtol=0, atol=0)
    torch.testing.assert_close(v_pages[0, :, 1], blocks[0, 1], rtol=0, atol=0)
