"""IceCache's index: a DCI tree per KV head over the keys that left the window (index, insert).

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Sec. 3.3, 4.1, App. B.1).

  Eqs. 2-3, T_K / T_Q          DCIForest._project (u.T_K(k)), query_projection (u.T_Q(q)),
                               _similarity (key to key, for parents)
  Algorithm 2, DCI-INDEXING    DCIForest.build: levels, each point's parent, pages
  Alg. 1 lines 26-36, insert   DCIForest.insert: a window page's keys into their parents' pages
  Algorithms 3-4, the query    search.py (readable); search_fast.py, pages_fast.py (batched:
                               they keep state beside the tree, which tells them of each change
                               through DCIForest.watchers)

With c >= every key's norm, T_K(k) = [k/c, sqrt(1 - |k|^2/c^2)] and T_Q(q) = [q/|q|, 0] are unit
vectors and |T_Q(q) - T_K(k)|^2 = 2 - 2 q.k/(|q| c): the nearest key has the largest q.k. Between
keys, 1/2 |T_K(a) - T_K(b)|^2 = 1 - sim(a, b)/c^2, sim(a, b) = a.b + sqrt(c^2-|a|^2) sqrt(c^2-|b|^2).

Decisions (docs/design.md, "icecache" and "The paper as a preset"). The default follows the
authors' M-DCI code, also where it departs from the paper (the first, third and fourth points);
icecache:paper's rules are the parameters named beside them:
  * one random unit vector u in R^{D+1} for every layer and head (m = 1 simple index, L = 1);
    pdci.PDCIForest projects on m L of them (Sec. 3.3's several indices);
  * c is the running maximum key norm per head; when it grows every projection is recomputed
    from u[:D].k and |k|^2, so nothing stale survives (q.k itself does not depend on c);
  * promotion by a deterministic counter in insertion order: point t reaches level 2 when t + 1
    is a multiple of 100 (ratio 0.01), each higher level every 5th (0.2); one level per point.
    promotion=random (icecache:paper) gives the forest the paper's levels instead, drawn ahead
    by promotion_levels (Alg. 1 lines 29-33, Alg. 2: "while Random(0, 1) < r");
  * a point's parent is its nearest point one level up (largest sim, exactly; ties to the older);
    descent=greedy (pdci.PDCIForest) finds it with the paper's QUERY(k, T, l + 1, 1) instead;
  * pages (the leaves) are runs of at most page_size children of one parent in projection order;
    an inserted point goes to its parent's open page, a new page when full: no token ever moves.
    A point that opens a new top level adopts the old top level and the root's pages unchanged
    (a point drawn more than one level above the top opens one level: the levels stay gapless).
"""
from __future__ import annotations

import random

import torch

FIRST_PROMOTION = 100  # a point in 100 reaches level 2 (the authors' ratio_1 = 0.01)
NEXT_PROMOTION = 5  # a level-l point in 5 reaches level l + 1 (ratio_2 = 0.2)


def level_of(t: int, first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION) -> int:
    """Level of the t-th point (0-based, insertion order) under the deterministic promotion counter."""
    n = t + 1
    if n % first:
        return 1
    level, n = 2, n // first
    while n % nxt == 0:
        level, n = level + 1, n // nxt
    return level


def levels_of(t: torch.Tensor, first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION) -> torch.Tensor:
    """level_of for a tensor of point indices t (int64) at once."""
    n = t + 1
    level = torch.ones_like(n)
    up = n % first == 0
    n = n // first
    while bool(up.any()):  # one pass per level: at most log_nxt(n / first) + 1 of them
        level += up
        n, up = n // nxt, up & (n % nxt == 0)
    return level


def promotion_stream(seed: int, layer: int) -> random.Random:
    """The Random(0, 1) of the paper's promotion for the tree of `layer` (its KV heads share it):
    Python's Mersenne Twister seeded with the string "icecache/<seed>/<layer>"."""
    return random.Random(f"icecache/{seed}/{layer}")


def promotion_levels(n: int, r: float, stream: random.Random) -> torch.Tensor:
    """The paper's random promotion (Alg. 1 lines 29-33, Alg. 2) for points 0..n-1 in insertion
    order, each taking its draws from `stream` after the points before it -> levels (n,) int64.
    The draws of point t do not depend on when it is inserted, so the forest draws them ahead."""
    levels = []
    for _ in range(n):
        level = 1  # start at the bottom level
        while stream.random() < r:  # while Random(0, 1) < r: promote to the next higher level
            level += 1
        levels.append(level)
    return torch.tensor(levels, dtype=torch.int64)


def random_direction(head_dim: int, seed: int = 0) -> torch.Tensor:
    """The one projection vector u (D + 1,), unit norm, float32 (shared by all layers and heads)."""
    return random_directions(head_dim, 1, seed)[0]


def random_directions(head_dim: int, n: int, seed: int = 0) -> torch.Tensor:
    """n projection vectors (n, D + 1), each of unit norm, float32: randn(D + 1) in float64 drawn
    n times in turn from one generator seeded with `seed`, each normalised (the first is
    random_direction's; one draw per vector, as torch draws a long tensor otherwise)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.stack([torch.randn(head_dim + 1, generator=g, dtype=torch.float64) for _ in range(n)])
    return (u / u.norm(dim=1, keepdim=True)).float()


class DCIForest:
    """One DCI tree per KV head over the same tokens (their keys differ per head). Tree ids are
    insertion order: tree id t is the t-th key inserted. See the module docstring.

    slot_keys (H, max_pages P, D) float32: the index's copy of the keys, page by page (row c P + s
    holds page c's slot s; empty slots are zero). Per point: level (shared by the heads: the promotion
    depends only on t), parent (H, cap), and its page and slot (H, cap): its row is page P + slot.
    Per page: fill (H, max_pages) and the tree id in each slot. watchers: what keeps state
    derived from the tree (the batched searches), told of each change (joined, changed)."""

    def __init__(self, *, n_heads: int, head_dim: int, page_size: int, capacity: int, u: torch.Tensor,
                 first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION, levels: torch.Tensor | None = None):
        H, D, P = n_heads, head_dim, page_size
        self.H, self.D, self.P, self.cap = H, D, P, capacity
        self.first, self.nxt = first, nxt
        # levels (capacity,): the level of each insertion index drawn ahead (promotion_levels);
        # None: the deterministic counter (levels_of)
        self.drawn = None if levels is None else levels[:capacity].clone()
        self.u = u.float()  # (D + 1,)
        # pages: every parent has at most one page that is not full (its open one), and the
        # parents are the root and the points above level 1 (capacity // first under the counter)
        parents = capacity // first if levels is None else int((self.drawn > 1).sum())
        self.max_pages = capacity // P + parents + 2
        self.n = 0
        self.top = 0  # number of levels (0: empty tree)
        # the index's keys, page-major: (H, max_pages P, D), a point's row its page's P rows plus its
        # slot. A point never changes page, so the rows never move (a search may keep positions)
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
        self.watchers: list = []  # told of each change: joined(level, run) or changed()
        self.parent = torch.full((H, capacity), -1, dtype=torch.int64)
        self.page_of = torch.full((H, capacity), -1, dtype=torch.int64)
        self.slot_of = torch.full((H, capacity), -1, dtype=torch.int64)
        self.fill = torch.zeros(H, self.max_pages, dtype=torch.int64)
        self.page_token = torch.full((H, self.max_pages, P), -1, dtype=torch.int64)  # tree id per slot
        self.n_pages = [0] * H
        self.open_page: list[dict[int, int]] = [{} for _ in range(H)]  # parent -> its open page
        self.scored = 0  # keys scored by searches, and the keys in the tree at each: stats
        self.searched = 0

    # -- the MIPS transform (Eqs. 2-3) ---------------------------------------------------------
    def _project(self, uk: torch.Tensor, sq: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        # u.T_K(k) = (u[:D].k + u[D] sqrt(c^2 - |k|^2)) / c      uk, sq (H, n), c (H,)
        c = c[:, None].clamp_min(1e-30)
        return ((uk + self.u[-1].double() * (c * c - sq).clamp_min(0).sqrt()) / c).float()

    def query_projection(self, q: torch.Tensor) -> torch.Tensor:
        """u.T_Q(q) for q (R, D) -> (R,)."""
        q = q.float()
        return (q @ self.u[:-1]) / q.norm(dim=-1).clamp_min(1e-30)

    def _similarity(self, a: torch.Tensor, sq_a: torch.Tensor, b: torch.Tensor, sq_b: torch.Tensor) -> torch.Tensor:
        # sim(a, b) = a.b + sqrt(c^2 - |a|^2) sqrt(c^2 - |b|^2): a (H, m, D), sq_a (H, m); b (H, n, D),
        # sq_b (H, n) -> (H, m, n); the nearest under T_K has the largest sim
        c2 = (self.c * self.c)[:, None]
        tail = (c2 - sq_a).clamp_min(0).sqrt()[:, :, None] * (c2 - sq_b).clamp_min(0).sqrt()[:, None, :]
        return torch.bmm(a, b.transpose(1, 2)) + tail.float()

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """(H, m) the slot_keys row of tree ids (m,), placed in their pages: page P + slot."""
        return self.page_of[:, ids] * self.P + self.slot_of[:, ids]

    def head_keys(self, h: int, ids: torch.Tensor) -> torch.Tensor:
        """The keys of head h's tree ids (m,) -> (m, D) float32."""
        return self.slot_keys[h, self.page_of[h, ids] * self.P + self.slot_of[h, ids]]

    def key_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The keys of tree ids (m,) (placed in their pages) -> (H, m, D) float32."""
        return self.slot_keys.gather(1, self.rows_of(ids)[:, :, None].expand(-1, -1, self.D))

    def _write_rows(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        # keys (H, m, D) of tree ids (m,), just placed: into their page rows
        self.slot_keys.scatter_(1, self.rows_of(ids)[:, :, None].expand(-1, -1, self.D), keys.float())

    def _grow_norm(self, sq_new: torch.Tensor) -> None:
        # sq_new (H, m): raise c where a new key is longer, and reproject every point exactly
        c_new = torch.maximum(self.c, sq_new.amax(dim=1).sqrt())
        if torch.equal(c_new, self.c):
            return
        self.c = c_new
        self._changed()  # every projection changed
        n = self.n
        self.proj[:, :n] = self._project(self.uk[:, :n], self.sq[:, :n], self.c)

    def _store(self, keys: torch.Tensor) -> None:
        # keys (H, m, D): append points n..n+m-1 (norms, projections; the key rows once placed)
        m, a = keys.shape[1], self.n
        if a + m > self.cap:
            raise ValueError(f"the DCI tree holds at most {self.cap} keys, {a + m} asked")
        k = keys.float()
        sq = k.double().square().sum(-1)
        self._grow_norm(sq)
        self.sq[:, a:a + m] = sq
        self.uk[:, a:a + m] = k @ self.u[:-1]
        self.proj[:, a:a + m] = self._project(self.uk[:, a:a + m], sq, self.c)

    # -- levels ----------------------------------------------------------------------------------
    def levels_for(self, a: int, m: int) -> torch.Tensor:
        """The levels (m,) the points a..a+m-1 are promoted to (before build removes empty levels
        and insert caps them at one above the top)."""
        if self.drawn is None:
            return levels_of(torch.arange(a, a + m), self.first, self.nxt)
        return self.drawn[a:a + m]

    def level_ids(self, level: int) -> torch.Tensor:
        """Tree ids on `level`, in insertion order (a point's place in it is pos_in_level)."""
        return self._level_ids.get(level, torch.zeros(0, dtype=torch.int64))

    def _add_to_level(self, run: torch.Tensor, level: int) -> None:
        # the points run (r,) join `level`, after its current points
        ids = self.level_ids(level)
        self.pos_in_level[run] = torch.arange(ids.numel(), ids.numel() + run.numel())
        self.level[run] = level
        self._level_ids[level] = torch.cat((ids, run))

    # -- building (Algorithm 2) --------------------------------------------------------------------
    def build(self, keys: torch.Tensor) -> None:
        """Index keys (H, n, D) into an empty forest: levels, parents, pages."""
        if self.n:
            raise ValueError("build() indexes an empty forest; use insert() to add keys")
        n = keys.shape[1]
        if n == 0:
            return
        self._store(keys)
        levels = self.levels_for(0, n).unique(return_inverse=True)[1] + 1  # "Remove the empty levels"
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

    def _build_parents(self, keys: torch.Tensor) -> None:
        # each point's parent: its nearest point one level up (the top level's: the root, -1)
        for level in range(1, self.top):
            ids, up = self.level_ids(level), self.level_ids(level + 1)
            k_up = keys[:, up].float()
            for a in range(0, len(ids), 4096):  # bounded temporaries: (H, 4096, n_{l+1})
                chunk = ids[a:a + 4096]
                sim = self._similarity(keys[:, chunk].float(), self.sq[:, chunk], k_up, self.sq[:, up])
                self.parent[:, chunk] = up[sim.argmax(dim=2)]

    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
        """Parents (H, r) on level + 1 of the points run (r,), keys (H, r, D), about to join `level`:
        Alg. 4 with k = 1 at level l + 1, exactly (no point of the run is on level l + 1)."""
        up = self.level_ids(level + 1)
        sim = self._similarity(keys.float(), self.sq[:, run], self.key_rows(up), self.sq[:, up])
        return up[sim.argmax(dim=2)]  # (H, r)

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

    # -- insertion (Algorithm 1, lines 26-36) ------------------------------------------------------
    def insert(self, keys: torch.Tensor) -> None:
        """Insert keys (H, m, D), in token order."""
        m = keys.shape[1]
        if self.n == 0:  # nothing to insert into yet: the first keys build the tree
            self.build(keys)
            return
        a = self.n
        self._store(keys)
        levels = self.levels_for(a, m).tolist()
        t = a
        while t < a + m:  # runs of points on one level: their parents in one product
            level = levels[t - a]
            if level > self.top:
                self._raise_top(t)
                level = self.top
            end = t + 1
            while end < a + m and levels[end - a] == level:
                end += 1
            run = torch.arange(t, end)
            if level == self.top:
                parents = torch.full((self.H, end - t), -1, dtype=torch.int64)
            else:
                parents = self._find_parents(level, keys[:, t - a:end - a], run)
            self._add_to_level(run, level)
            for watcher in self.watchers:
                watcher.joined(level, run)
            self.parent[:, run] = parents
            self.n = end
            self._place(run, parents)
            self._write_rows(run, keys[:, t - a:end - a])
            t = end

    def _raise_top(self, t: int) -> None:
        # point t opens level top + 1: the old top level (the root's children) become its
        # children, the root's pages its pages (no token moves), and t becomes the root's child
        old_top = self.level_ids(self.top)
        self.parent[:, old_top] = t
        self._changed()
        for h in range(self.H):
            if -1 in self.open_page[h]:
                self.open_page[h][t] = self.open_page[h].pop(-1)
        self.top += 1

    def _place(self, run: torch.Tensor, parents: torch.Tensor) -> None:
        # points run (r,) into their parents' open pages (H, r), a new page where one is full;
        # in token order per head, on Python ints, then written to the tensors at once
        fill, P = self.fill.tolist(), self.P
        heads, tokens, pages, slots = [], [], [], []
        for h, row in enumerate(parents.tolist()):
            open_page = self.open_page[h]
            for t, parent in zip(run.tolist(), row):
                page = open_page.get(parent)
                if page is None or fill[h][page] == P:
                    page = open_page[parent] = self.n_pages[h]
                    self.n_pages[h] += 1
                heads.append(h), tokens.append(t), pages.append(page), slots.append(fill[h][page])
                fill[h][page] += 1
        heads, tokens, pages, slots = (torch.tensor(x, dtype=torch.int64) for x in (heads, tokens, pages, slots))
        self.page_of[heads, tokens], self.slot_of[heads, tokens] = pages, slots
        self.page_token[heads, pages, slots] = tokens
        self.fill[heads, pages] = slots + 1

    def _changed(self) -> None:
        # projections or parents changed: what the watchers derived from them is stale
        for watcher in self.watchers:
            watcher.changed()

    # -- reading ---------------------------------------------------------------------------------
    def page_tokens(self, h: int, page: int) -> list[int]:
        """Tree ids in page `page` of head h, in slot order."""
        return self.page_token[h, page, :int(self.fill[h, page])].tolist()

    def nbytes(self) -> int:
        tensors = [self.slot_keys, self.sq, self.uk, self.proj, self.c, self.level, self.pos_in_level, self.parent,
                   self.page_of, self.slot_of, self.fill, self.page_token]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(w.nbytes() for w in self.watchers)
