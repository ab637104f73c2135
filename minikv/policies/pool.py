"""The device page pool the page-based policies share (freekv, icecache), and its slot bookkeeping.

A policy's paged storage is this pool plus the candidate store the policy needs (freekv's host
pages with their digests, host_pages.py; icecache's semantic pages, icecache/layer.py): the pool
holds what attention reads, the store what it may read later, and `assign_slots` decides which
slots a recall writes. Copies between the two go through the policy's Tiers (tiers.py), which
counts them.

PagePool: S slots of P tokens on the device tier, NHD (S, P, Hkv, D) as FreeKV lays them out.
Slot s of KV head m holds whatever page head m put there. Attention reads the slots through
`page_table` (1, Hkv, S), the identity, and `page_lens` (1, Hkv, S): the valid tokens of each
slot, P for a full page, fewer for a partly filled one (masked, never padded into attention), 0
for an unused slot: kernels/paged_attention, or a fast form of it the policy passes
(pool_fast.pool_attention, eager: the pool read in place).
"""
from __future__ import annotations

from functools import partial

import torch

from ..kernels.paged_attention import paged_attention


def assign_slots(held: list[int], want: list[int]) -> list[tuple[int, int]]:
    """One head's slots after a new selection: which slot each newly selected item goes to (the
    copy itself is the caller's). held: what each slot holds (-1: empty), updated in place; want:
    the new selection (-1: none, no duplicates). Items already held stay where they are; the slots
    of items that left the selection are freed; the j-th missing item (in selection order) goes to
    the j-th free slot (in slot order): there are always enough, the selection being no longer
    than the slots. -> [(item, slot)] to copy in."""
    keep, holding = set(want) - {-1}, set(held)  # sets: a selection has up to thousands of items
    missing = [c for c in want if c >= 0 and c not in holding]
    free = [j for j, c in enumerate(held) if c not in keep]
    for j in free:
        held[j] = -1
    moves = list(zip(missing, free))
    for c, j in moves:
        held[j] = c
    return moves


class PagePool:
    """S device slots of P tokens for Hkv heads, their lengths, and attention over them."""

    def __init__(self, *, n_slots: int, page_size: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, backend: str, attention=None):
        S, P, H, D = n_slots, page_size, n_kv, head_dim
        self.S, self.P, self.backend = S, P, backend
        self.k_pages = torch.zeros(S, P, H, D, dtype=dtype, device=device)  # NHD
        self.v_pages = torch.zeros(S, P, H, D, dtype=dtype, device=device)
        self.page_table = torch.arange(S, dtype=torch.int32, device=device).expand(1, H, S).contiguous()
        self.page_lens = torch.zeros(1, H, S, dtype=torch.int32, device=device)
        # (q, k_pages, v_pages, page_table, page_lens) -> out: the kernel, or the policy's fast form
        self.attention = attention or partial(paged_attention, backend=backend)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Tokens start.. of `slot` for every head: k, v (Hkv, n, D); the slot now holds start + n."""
        n = k.shape[1]
        self.k_pages[slot, start:start + n] = k.transpose(0, 1)
        self.v_pages[slot, start:start + n] = v.transpose(0, 1)
        self.page_lens.select(2, slot).fill_(start + n)  # page_lens[0, :, slot]

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) over every slot's valid tokens -> (1, Hq, D)."""
        return self.attention(q, self.k_pages, self.v_pages, self.page_table, self.page_lens)


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
