"""A DCI forest's construction (tree.DCIForest inherits it; its insert grows the tree afterwards):
its state, allocated once for `capacity` points, and Algorithm 2 (DCI-INDEXING), the bulk build
over the keys a prefill leaves between the sink and the window.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Alg. 2, App. B.1).

  levels     the promoted levels of the points, "Remove the empty levels"
  parents    each point's nearest point one level up (largest sim, exactly; ties to the older;
             pdci.PDCIForest overrides _build_parents with QUERY's descent); the top level's: the root
  pages      per parent, its children in projection order, cut into runs of at most page_size
             (_cut_pages): the leaves, which insert then fills one point at a time

A prompt too short to leave a page between sink and window leaves an empty forest: the first
page that leaves the window during decoding is built here (insert into an empty forest).
"""
from __future__ import annotations

import torch

from .promotion import FIRST_PROMOTION, NEXT_PROMOTION, levels_of


class Build:
    """DCIForest's construction (see the module docstring; tree.DCIForest lists the state)."""

    def __init__(self, *, n_heads: int, head_dim: int, page_size: int, capacity: int, u: torch.Tensor,
                 first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION, levels: torch.Tensor | None = None):
        H, D, P = n_heads, head_dim, page_size
        self.H, self.D, self.P, self.cap = H, D, P, capacity
        # promoted (capacity,): the level each insertion index is promoted to, drawn ahead
        # (promotion.py: promotion_levels, or by default the counter, levels_of)
        self.promoted = levels_of(torch.arange(capacity), first, nxt) if levels is None else levels[:capacity].clone()
        self.u = u.float()  # (D + 1,)
        # every parent (the root and the points above level 1) has at most one page not full
        self.max_pages = capacity // P + int((self.promoted > 1).sum()) + 2
        self.n = 0
        self.top = 0  # number of levels (0: empty tree)
        # the keys, page-major: a point never changes page, so its row never moves
        self.slot_keys = torch.zeros((H, self.max_pages * P, D), dtype=torch.float32, device="cpu")
        # |k|^2 and c in float64: sqrt(c^2 - |k|^2) of the longest keys, the ones MIPS is about,
        # takes the square root of a difference near 0, where float32 would lose ~1e-3
        self.sq = torch.zeros(H, capacity, dtype=torch.float64)  # |k|^2
        self.uk = torch.zeros(H, capacity)  # u[:D].k
        self.proj = torch.zeros(H, capacity)  # u.T_K(k) at the current c
        self.c = torch.zeros(H, dtype=torch.float64)  # running max key norm, per head
        self.level = torch.zeros(capacity, dtype=torch.int64)
        self.pos_in_level = torch.zeros(capacity, dtype=torch.int64)
        self._level_ids: dict[int, torch.Tensor] = {}  # level -> its tree ids (level_ids)
        self.parent = torch.full((H, capacity), -1, dtype=torch.int64)
        self.page_of = torch.full((H, capacity), -1, dtype=torch.int64)
        self.slot_of = torch.full((H, capacity), -1, dtype=torch.int64)
        self.fill = torch.zeros(H, self.max_pages, dtype=torch.int64)
        self.page_token = torch.full((H, self.max_pages, P), -1, dtype=torch.int64)  # tree id per slot
        self.n_pages = [0] * H
        self.open_page: list[dict[int, int]] = [{} for _ in range(H)]  # parent -> its open page
        self.watchers: list = []  # the batched searches beside the tree, told of a build
        self.scored = self.searched = 0  # statistics (counts.py): keys the searches scored, of those indexed

    def build(self, keys: torch.Tensor) -> None:
        """Index keys (H, n, D) into an empty forest: levels, parents, pages."""
        if self.n:
            raise ValueError("build() indexes an empty forest; use insert() to add keys")
        n = keys.shape[1]
        if n == 0:
            return
        self._store(keys)
        levels = self.promoted[:n].unique(return_inverse=True)[1] + 1  # "Remove the empty levels"
        self.level[:n] = levels
        self.top = int(levels.max())
        for level in range(1, self.top + 1):
            ids = (levels == level).nonzero()[:, 0]
            self.pos_in_level[ids] = torch.arange(ids.numel())
            self._level_ids[level] = ids
        self.n = n
        self._build_parents(keys)
        for h in range(self.H):
            self._cut_pages(h)
        self._write_rows(torch.arange(n), keys)
        for watcher in self.watchers:  # the batched search builds what it keeps beside the tree now
            watcher.built()

    def _build_parents(self, keys: torch.Tensor) -> None:
        # each point's parent: its nearest point one level up (the top level's: the root, -1)
        for level in range(1, self.top):
            ids, up = self.level_ids(level), self.level_ids(level + 1)
            k_up = keys[:, up].float()
            for a in range(0, len(ids), 4096):  # bounded temporaries: (H, 4096, n_{l+1})
                chunk = ids[a:a + 4096]
                sim = self._similarity(keys[:, chunk].float(), self.sq[:, chunk], k_up, self.sq[:, up])
                self.parent[:, chunk] = up[sim.argmax(dim=2)]

    def _cut_pages(self, h: int) -> None:
        # pages of head h: children of one parent, in projection order, runs of <= P
        n, P = self.n, self.P
        by_proj = self.proj[h, :n].argsort(stable=True)
        order = by_proj[self.parent[h, by_proj].argsort(stable=True)]  # grouped by parent, then projection
        par = self.parent[h, order]
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = par[1:] != par[:-1]
        ar = torch.arange(n)
        pos = ar - torch.where(starts, ar, 0).cummax(0).values  # position within its parent's children
        page = (starts | (pos % P == 0)).cumsum(0) - 1
        self.page_of[h, order] = page
        self.slot_of[h, order] = pos % P
        self.page_token[h, page, pos % P] = order
        self.n_pages[h] = int(page[-1]) + 1
        self.fill[h, :self.n_pages[h]] = torch.bincount(page, minlength=self.n_pages[h])
        ends = torch.ones(n, dtype=torch.bool)
        ends[:-1] = starts[1:]
        self.open_page[h] = dict(zip(par[ends].tolist(), page[ends].tolist()))
