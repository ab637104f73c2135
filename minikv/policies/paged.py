"""Paged KV storage of one layer for the page-based policies: a device page pool (pool.py) plus
a store of candidate pages (freekv's HostPages, host_pages.py; icecache's SemanticPages).

Page p holds tokens [p P, (p + 1) P). Three kinds of pages, each with its own home:

    sink pages      pages 0 .. n_sink-1: on the device tier for good, read at every step
    window pages    the n_window latest pages, the last one partly filled: a ring of device
                    slots; attention reads between (n_window - 1) P + 1 and n_window P recent
                    tokens, so a window of W tokens takes W / P + 1 pages
    candidates      pages that left the window, on the host tier; a chosen few per KV head come
                    back into n_select device slots

Where to read what:

    PagedKV.append                 one token into the partly filled last page (the prompt:
                                   paged_prefill.py, the state its tokens' appends would reach)
    PagedKV.roll                   the last page filled and the ring is full: the oldest window
                                   page is offloaded and becomes a candidate (leave_window, then
                                   store; icecache's paper order runs attention between the two)
    PagedKV.recall, _copy_in       incremental recall: only pages not already resident are
                                   copied, into the slots of pages that left the selection
                                   (pool.assign_slots), through Tiers.copy_in
    PagedKV.attend                 attention over every occupied slot (recording what it read:
                                   paged_stats.py counts the tiers and the tokens read)

Decisions (docs/design.md, "freekv"): the pool holds S = n_sink + n_select + n_window slots in
that order; sink and window slots hold the same page for every head, selected slots a page per
head. Slot bookkeeping is host-side (one small sync per layer on CUDA). Under CUDA a background
recall runs on a side stream, a correction on the main one; `attend` waits for the last. A store
fits if it answers offload, host, lens and page_tokens.
"""
from __future__ import annotations

import math

import torch

from ..kernels.page_gather import page_gather
from ..kernels.page_layout import hnd_to_nhd
from .paged_prefill import PagedPrefill
from .paged_stats import PagedStats
from .pool import PagePool, Staging, assign_slots
from .tiers import backend_on


class PagedKV(PagedPrefill, PagedStats):
    """Paged KV of one layer for one sequence (batch 1): a PagePool and a candidate store (see the
    module docstring). The prompt comes in through paged_prefill.py (prefill: the state T appends
    would reach); what it holds and what attention read are counted in paged_stats.py.
    `attention`: the pool's (pool.PagePool), None for kernels/paged_attention under `backend`."""

    def __init__(self, *, candidates, n_kv: int, head_dim: int, page_size: int, max_len: int, n_sink: int,
                 n_select: int, n_window: int, dtype: torch.dtype, tiers, backend: str, staging: Staging,
                 attention=None):
        if n_window < 1:
            raise ValueError(f"n_window must be >= 1 (the partly filled last page is always attended), got {n_window}")
        self.P, self.Hkv, self.D = page_size, n_kv, head_dim
        self.n_sink, self.n_select, self.n_window = n_sink, n_select, n_window
        self.candidates, self.tiers, self.backend = candidates, tiers, backend
        self.max_pages = max(1, math.ceil(max_len / page_size))  # the sequence's pages, at most
        self.S = n_sink + n_select + n_window
        self.w0 = n_sink + n_select  # first window slot
        self.pool = PagePool(n_slots=self.S, page_size=page_size, n_kv=n_kv, head_dim=head_dim, dtype=dtype,
                             device=tiers.device, backend=backend, attention=attention)
        # candidate held by each selected slot of each KV head (-1 = empty), and its valid tokens:
        # host-side bookkeeping of Hkv * n_select integers, in Python lists (a tensor op costs
        # more than the whole Python loop over them)
        self.held = [[-1] * n_select for _ in range(n_kv)]
        self.held_lens = [[0] * n_select for _ in range(n_kv)]
        self.length = 0  # tokens stored
        self.n_cand = 0  # pages offloaded so far = candidates
        self.pages_recalled = 0
        # the gather reads the host tier: eager beside a GPU, `backend` on a CPU-only machine
        self.gather_backend = backend_on("host", backend, tiers.device)
        # one recall moves at most every selected slot of every head (n_kv * n_select, 2, P, D):
        # the policy's, shared by its layers
        self.staging = staging
        self.last_read = (0, 0, [list(row) for row in self.held], [list(row) for row in self.held_lens])

    # -- where pages live --------------------------------------------------------------------
    def slot_of(self, page: int) -> int:
        """Device slot of a sink or window page."""
        return page if page < self.n_sink else self.w0 + (page - self.n_sink) % self.n_window

    # -- writing -----------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token: k, v (1, Hkv, 1, D) into the partly filled last page of the window."""
        page, off = divmod(self.length, self.P)
        if page >= self.max_pages:
            raise ValueError(f"the sequence outgrew max_len ({self.max_pages * self.P} tokens)")
        self.pool.write(self.slot_of(page), k[0], v[0], start=off)
        self.length += 1

    def roll(self) -> bool:
        """If the last page just filled up and the window ring is full, offload the oldest window
        page so that its slot takes the next page. Call after each step's attention; returns True
        when a page became a candidate (the selection must then be recomputed)."""
        left = self.leave_window()
        if left is not None:
            self.store(*left)
        return left is not None

    def leave_window(self):
        """The first half of roll: if the last page just filled up and the ring is full, the
        oldest window page leaves the device (attention no longer reads it; it counts as a
        candidate) -> (k, v, first): its pages (1, P, Hkv, D), views of its freed slot, valid
        until the next page's first token, and its candidate index; else None. `store` puts it
        into the candidate store (icecache's paper order: leave before attention, store after)."""
        if self.length % self.P or self.length <= self.n_sink * self.P:
            return None
        first_window = self.n_sink + self.n_cand
        last = self.length // self.P - 1
        if last - first_window + 1 < self.n_window:
            return None
        s = self.slot_of(first_window)
        self.pool.page_lens[0, :, s] = 0
        self.n_cand += 1
        return self.pool.k_pages[s:s + 1], self.pool.v_pages[s:s + 1], self.n_cand - 1

    def store(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """Pages that left the device, k, v (n, P, Hkv, D) NHD, into the candidate store as
        candidates first.. . A store whose pages grow (icecache's) names the pages that changed:
        a slot holding one is emptied, and the next recall copies it again."""
        grown = self.candidates.offload(k, v, first)
        for h, pages in enumerate(grown or ()):
            for j, c in enumerate(self.held[h]):
                if c in pages:
                    self.held[h][j], self.held_lens[h][j] = -1, 0
                    self.pool.page_lens[0, h, self.n_sink + j] = 0

    # -- recall ------------------------------------------------------------------------------
    def recall(self, selection: torch.Tensor, heads=None, background: bool = False) -> int:
        """Make the selected slots hold `selection` (Hkv, n_select) candidates (-1: none), for the
        KV heads where `heads` (Hkv,) bool (tensor or list) is True (all by default). Copies only
        missing pages; every slot's length is its page's fill. Returns the number of pages copied."""
        rows = selection.tolist()  # bookkeeping is host-side (on CUDA: one small sync)
        on = heads.tolist() if isinstance(heads, torch.Tensor) else heads
        moves = []  # (host row, device slot, KV head) of each page to copy
        emptied_or_filled = False
        for h, want in enumerate(rows):
            if on is not None and not on[h]:
                continue  # this head keeps what it holds
            was_used = [c >= 0 for c in self.held[h]]
            moves += [(c * self.Hkv + h, self.n_sink + j, h) for c, j in assign_slots(self.held[h], want)]
            emptied_or_filled |= was_used != [c >= 0 for c in self.held[h]]
        if moves:
            self._copy_in(moves, background)
        if moves or emptied_or_filled:  # the held pages changed: their lengths, from the store
            self.held_lens = self.candidates.lens(self.held)
            lens = torch.tensor(self.held_lens, dtype=torch.int32)
            self.pool.page_lens[0, :, self.n_sink:self.w0].copy_(lens, non_blocking=True)
        self.pages_recalled += len(moves)
        return len(moves)

    def _copy_in(self, moves: list[tuple[int, int, int]], background: bool) -> None:
        # gather the blocks (rows of host viewed as (max_pages * Hkv, 2, P, D)) into a staging
        # buffer, one contiguous host read per block; one transfer; the HND -> NHD kernel
        # scatters them into their slots
        flat, slots, heads = (torch.tensor(column) for column in zip(*moves))  # (n,) each
        host_rows = self.candidates.host.view(-1, 2, self.P, self.D)
        pool = self.pool

        def gather(buffer):
            return page_gather(host_rows, flat, buffer, backend=self.gather_backend)

        def scatter(blocks):
            hnd_to_nhd(blocks, pool.k_pages, pool.v_pages, slots.to(blocks.device, non_blocking=True),
                       heads.to(blocks.device, non_blocking=True), backend=self.backend)

        self.tiers.copy_in(self.staging, gather, scatter, into=pool, background=background)

    # -- reading -----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) over every device slot with a token -> (1, Hq, D)."""
        self.tiers.wait(self.pool)
        self.last_read = (self.length, self.n_cand, [list(row) for row in self.held],
                          [list(row) for row in self.held_lens])
        return self.pool.attend(q)
