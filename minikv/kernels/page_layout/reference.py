"""HND -> NHD: scatter recalled pages into the device pool, eager reference (FreeKV, hybrid layout).

The host tier keeps pages in HND layout, (n_pages, Hkv, 2, P, D): one page of one KV head, keys
then values, is one contiguous block of 2 * P * D elements, so recalling a page of one head is one
large copy instead of P small ones (in NHD a head's P rows sit Hkv * D elements apart). The device
pool is NHD, (S, P, Hkv, D), the layout attention reads. After the blocks arrive on the device,
this transform writes block i into slot slots[i], KV head heads[i]:

    blocks      (n, 2, P, D)      recalled blocks, keys [:, 0] and values [:, 1], on the device
    k_pages     (S, P, Hkv, D)    the pool, written in place; v_pages likewise
    slots, heads (n,) int         destination of each block; (slot, head) pairs distinct
    -> None
"""
from __future__ import annotations

import torch


def hnd_to_nhd(blocks, k_pages, v_pages, slots, heads):
    slots = slots.long()
    heads = heads.long()
    # k_pages[slots[i], :, heads[i]] is (P, D): the advanced indices (slots, :, heads) put n first
    k_pages[slots, :, heads] = blocks[:, 0].to(k_pages.dtype)
    v_pages[slots, :, heads] = blocks[:, 1].to(v_pages.dtype)


def nhd_to_hnd(k, v):
    """The offload direction, done once per page (amortised): k, v (n, P, Hkv, D) NHD pages ->
    (n, Hkv, 2, P, D) HND blocks, contiguous."""
    return torch.stack((k, v), dim=2).permute(0, 3, 2, 1, 4).contiguous()  # (n, P, 2, Hkv, D) -> (n, Hkv, 2, P, D)
