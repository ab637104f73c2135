"""The device page pool the page-based policies share (freekv, icecache), and its slot bookkeeping.

A policy's paged storage is this pool plus the candidate store the policy needs (freekv's host
pages with their digests, paged.py; icecache's semantic pages, icecache/policy.py): the pool holds what
attention reads, the store what it may read later, and `refill` decides which slots a recall
writes. Copies between the two go through the policy's Tiers (tiers.py), which counts them.

PagePool: S slots of P tokens on the device tier, NHD (S, P, Hkv, D) as FreeKV lays them out.
Slot s of KV head m holds whatever page head m put there. Attention reads the slots through
`page_table` (1, Hkv, S), the identity, and `page_lens` (1, Hkv, S): the valid tokens of each
slot, P for a full page, fewer for a partly filled one (masked, never padded into attention), 0
for an unused slot. Attention over the pool, by backend:

    reference   kernels/paged_attention's reference: gather the listed pages, dense attention
    eager       pool_attention: the same arithmetic over the pool in place, no gather (the fast
                CPU form, tested against the reference in tests/policies/test_paged.py)
    triton      the paged_attention kernel
"""
from __future__ import annotations

import math

import torch

from ..kernels.paged_attention import paged_attention
from ..models.attention import one_query_attention


def refill(held: list[int], want: list[int]) -> list[tuple[int, int]]:
    """One head's slots after a new selection. held: what each slot holds (-1: empty), updated in
    place; want: the new selection (-1: none, no duplicates). Items already held stay where they
    are; the slots of items that left the selection are freed; the j-th missing item (in
    selection order) goes to the j-th free slot (in slot order): there are always enough, the
    selection being no longer than the slots. -> [(item, slot)] to copy in."""
    keep, holding = set(want) - {-1}, set(held)  # sets: a selection has up to thousands of items
    missing = [c for c in want if c >= 0 and c not in holding]
    free = [j for j, c in enumerate(held) if c not in keep]
    for j in free:
        held[j] = -1
    moves = list(zip(missing, free))
    for c, j in moves:
        held[j] = c
    return moves


def pool_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_lens: torch.Tensor) -> torch.Tensor:
    """paged_attention through the identity page table, reading the pool in place: q (1, Hq, D),
    k_pages, v_pages (S, P, Hkv, D), page_lens (1, Hkv, S) -> (1, Hq, D). Slot s of KV head m
    shows its first page_lens[0, m, s] tokens; the rest get weight exactly 0. Unlike the
    reference it does not zero the hidden values: the pool only ever holds KV written by the
    model, finite, and 0 times a finite value is 0."""
    S, P, Hkv, D = k_pages.shape
    hidden = (torch.arange(P, device=q.device) >= page_lens[0, :, :, None]).view(Hkv, 1, S * P)
    k = k_pages.view(S * P, Hkv, D).transpose(0, 1)[None].float()  # (1, Hkv, S P, D): a view (a float32 copy in half precision)
    v = v_pages.view(S * P, Hkv, D).transpose(0, 1)[None].float()
    return one_query_attention(q.float()[:, :, None], k, v, 1.0 / math.sqrt(D), hidden)[:, :, 0].to(q.dtype)


class PagePool:
    """S device slots of P tokens for Hkv heads, their lengths, and attention over them."""

    def __init__(self, *, n_slots: int, page_size: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, backend: str):
        S, P, H, D = n_slots, page_size, n_kv, head_dim
        self.S, self.P, self.backend = S, P, backend
        self.k_pages = torch.zeros(S, P, H, D, dtype=dtype, device=device)  # NHD
        self.v_pages = torch.zeros(S, P, H, D, dtype=dtype, device=device)
        self.page_table = torch.arange(S, dtype=torch.int32, device=device).expand(1, H, S).contiguous()
        self.page_lens = torch.zeros(1, H, S, dtype=torch.int32, device=device)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Tokens start.. of `slot` for every head: k, v (Hkv, n, D); the slot now holds start + n."""
        n = k.shape[1]
        self.k_pages[slot, start:start + n] = k.transpose(0, 1)
        self.v_pages[slot, start:start + n] = v.transpose(0, 1)
        self.page_lens.select(2, slot).fill_(start + n)  # page_lens[0, :, slot]

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) over every slot's valid tokens -> (1, Hq, D)."""
        if self.backend == "eager":  # the table is the identity (entry j is slot j): no gather
            return pool_attention(q, self.k_pages, self.v_pages, self.page_lens)
        return paged_attention(q, self.k_pages, self.v_pages, self.page_table, self.page_lens, backend=self.backend)

    def aux_bytes(self) -> int:
        """Device bytes besides the K/V slots: the page table and lengths."""
        return sum(t.numel() * t.element_size() for t in (self.page_table, self.page_lens))


class Staging:
    """The two staging buffers recalls use in turn: pinned host and device, `shape` each.

    One per policy, not per layer, where layers run one after another: a buffer is refilled only
    after the host has waited for the copy that last read it (Tiers.copy_in), whichever layer
    issued that copy. Per layer they would cost as much memory as the selected pages themselves."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, tiers):
        self.host = [torch.empty(shape, dtype=dtype, pin_memory=tiers.pin) for _ in range(2)]
        self.dev = [torch.empty(shape, dtype=dtype, device=tiers.device) for _ in range(2)]
        self.turn = 0

    def take(self) -> int:
        """The buffer to fill next; the other one may still be in flight."""
        self.turn ^= 1
        return self.turn ^ 1

    def nbytes(self) -> tuple[int, int]:
        """(device, host) bytes."""
        return sum(t.numel() * t.element_size() for t in self.dev), sum(t.numel() * t.element_size() for t in self.host)
