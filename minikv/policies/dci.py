"""The DCI tree of IceCache: one per KV head of a layer, over the keys that left the window.

IceCache (Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence
LLMs", arXiv:2604.10539, 2026, an ICLR 2026 submission, https://arxiv.org/abs/2604.10539;
Sec. 3.3 and 4.1, Appendix B, Algorithms 1-4)
indexes keys with Multi-level DCI (M-DCI) and makes the tree's leaves its KV pages, so that a page
holds keys that point the same way rather than 16 consecutive tokens.

Maximum inner product as nearest neighbour (Appendix B.1). With c >= every key's norm,

    T_K(k) = [k / c, sqrt(1 - |k|^2 / c^2)]       (Eq. 2)      T_Q(q) = [q / |q|, 0]      (Eq. 3)

are unit vectors and |T_Q(q) - T_K(k)|^2 = 2 - 2 q.k / (|q| c), so the key nearest the query is
the key of largest q.k. Between two keys, 1/2 |T_K(a) - T_K(b)|^2 = 1 - sim(a, b) / c^2 with

    sim(a, b) = a.b + sqrt(c^2 - |a|^2) sqrt(c^2 - |b|^2)

(nearest key = largest sim). One random unit vector u in R^{D+1}, shared by every layer and head
(the authors' code: m = 1 simple index, L = 1 composite index), orders the points by their
projection u.T_K(k); DCI's lower bound on a distance is the gap between projections.

c is the running maximum key norm of the tree (per KV head) and may grow as keys are inserted.
Nothing stale survives a growth: projections are recomputed from u[:D].k and |k|^2 (kept per
point) for the new c, parent search uses the current c, and the query's exact scores q.k do not
depend on c at all.

Levels (Algorithm 2, "promotion"): the authors' code promotes by a deterministic counter in token
order rather than by sampling: point t (0-based, in insertion order) reaches level 2 when
(t + 1) is a multiple of 100 (= 1 / 0.01), level 3 when a multiple of 100 * 5 (higher levels
every 5th, 1 / 0.2), and so on. Each point lives on exactly one level; every point below the top
level has as parent its nearest point one level up (largest sim, ties to the older point; found
exactly: n_l x n_{l+1} similarities are cheap at these sizes, where the authors use a DCI query
or an anchor shortcut); top-level points are children of the root.

Pages (the tree's leaves, Sec. 4.1): the children of one parent (the root included), cut into
runs of at most page_size in projection order at build time. Every token (every level) is in
exactly one page. Insertion (Algorithm 1 lines 26-36) puts a new point into its parent's open
(last) page, and opens a new page for that parent when it is full: pages never split, so no token
ever moves. A point that opens a new top level becomes the parent of the old top level: the
root's pages become its pages unchanged (their members keep their page), and it joins the root.

Query (Algorithms 3 and 4, page selection): from the top level down, the candidates of a level
are the children of the `fov` best points expanded on the level above (all top-level points at
the start). Each node's children are scanned as the authors' M-DCI scans them with one simple
index (m = 1): outward from the query's projection u.T_Q(q) in the order of |u.T_K(k) - u.T_Q(q)|,
in batches of CLOSEST = 128 projections, until max(fov, ceil(prop size)) are scored (the
candidate stop, prop_to_retrieve = 0.8, checked after each batch); a node the field of view
covers (size <= fov) is scored whole. So nodes of up to 128 children are scored whole, and the
tree prunes by the field of view: only the children of the fov best points of a level are
looked at. (Where M-DCI picks a batch's side by the next projection, the window here is the m
nearest projections; the count is M-DCI's.) Scoring is exact, by q.k, and every scored point is
a candidate key. Pages are taken in the order of their best scored key, the first `k` distinct
ones. Field of view max(30, 0.0015 n) as in the authors' code. With fov >= n every point is
scored: the search is exact.

Speed: the search runs per level on all KV heads and all queries of a block at once. The parts
that do not depend on the query (the level's points grouped by node, each node's window size,
its pair sums x_i + x_{i+m}, see node_windows) are kept per level until an insertion; per query
and node, the window start is one searchsorted, and the block's candidates are the union of its
queries' windows (a +1/-1 at each window's ends and a cumulative sum).
"""
from __future__ import annotations

import torch

from ..kernels.dci_scores import dci_scores
from ..kernels.dci_scores.reference import stable_topk

CLOSEST = 128  # projections a node's scan scores per step before it checks its stop (M-DCI's CLOSEST)
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


def field_of_view(n: int) -> int:
    """Points expanded per level at query time: max(30, 0.0015 n) (the authors' query setting)."""
    return max(30, int(n * 1.5e-3))


def random_direction(head_dim: int, seed: int = 0) -> torch.Tensor:
    """The one projection vector u (D + 1,), unit norm, float32 (shared by all layers and heads)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(head_dim + 1, generator=g, dtype=torch.float64)
    return (u / u.norm()).float()


def first_k_distinct(x: torch.Tensor, k: int, n_values: int) -> torch.Tensor:
    """x (R, M) int64 values in [0, n_values) or -1 -> (R, k): each row's first k distinct values
    in order of first appearance, -1 padded."""
    R, M = x.shape
    big = M + 1
    first = torch.full((R, n_values + 1), big, dtype=torch.int64)
    pos = torch.arange(M, dtype=torch.int64).expand(R, M)
    first.scatter_reduce_(1, torch.where(x >= 0, x, n_values), pos, "amin")  # first position of each value
    first[:, n_values] = big  # the padding column
    k_eff = min(k, n_values + 1)
    at, value = first.topk(k_eff, dim=1, largest=False, sorted=True)  # earliest first (positions distinct)
    out = torch.where(at < big, value, -1)
    if k_eff < k:
        out = torch.cat((out, out.new_full((R, k - k_eff), -1)), dim=1)
    return out


class DCIForest:
    """One DCI tree per KV head over the same tokens (their keys differ per head). Tree ids are
    insertion order: tree id t is the t-th key inserted. See the module docstring.

    keys (H, cap, D) float32: the index's copy of the keys (the pages hold K and V for attention).
    Per point: level (shared by the heads: the counter depends only on t), parent (H, cap), and its
    page and slot (H, cap). Per page: fill (H, max_pages) and the tree id in each slot."""

    def __init__(self, *, n_heads: int, head_dim: int, page_size: int, capacity: int, u: torch.Tensor,
                 first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION, backend: str = "eager"):
        H, D, P = n_heads, head_dim, page_size
        self.H, self.D, self.P, self.cap = H, D, P, capacity
        self.first, self.nxt, self.backend = first, nxt, backend
        self.u = u.float()  # (D + 1,)
        # pages: every parent has at most one page that is not full (its open one), and the
        # parents are the root and the points above level 1 (at most capacity // first)
        self.max_pages = capacity // P + capacity // first + 2
        self.n = 0
        self.top = 0  # number of levels (0: empty tree)
        self.keys = torch.zeros(H, capacity, D)
        # |k|^2 and c in float64: sqrt(c^2 - |k|^2) of the longest keys, the ones MIPS is about,
        # takes the square root of a difference near 0, where float32 would lose ~1e-3
        self.sq = torch.zeros(H, capacity, dtype=torch.float64)  # |k|^2
        self.uk = torch.zeros(H, capacity)  # u[:D].k
        self.proj = torch.zeros(H, capacity)  # u.T_K(k) at the current c
        self.c = torch.zeros(H, dtype=torch.float64)  # running max key norm, per head
        self.level = torch.zeros(capacity, dtype=torch.int64)
        self.pos_in_level = torch.zeros(capacity, dtype=torch.int64)
        self.level_lists: dict[int, list[int]] = {}
        self._level_ids: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, tuple] = {}  # per level, see _layout
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

    def _similarity(self, a: torch.Tensor, sq_a: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # sim(a, b) = a.b + sqrt(c^2 - |a|^2) sqrt(c^2 - |b|^2): a (H, m, D), sq_a (H, m); b = the
        # tree's points ids (n,) -> (H, m, n); the nearest under T_K has the largest sim
        c2 = (self.c * self.c)[:, None]
        b, sq_b = self.keys[:, ids], self.sq[:, ids]
        tail = (c2 - sq_a).clamp_min(0).sqrt()[:, :, None] * (c2 - sq_b).clamp_min(0).sqrt()[:, None, :]
        return torch.bmm(a, b.transpose(1, 2)) + tail.float()

    def _grow_norm(self, sq_new: torch.Tensor) -> None:
        # sq_new (H, m): raise c where a new key is longer, and reproject every point exactly
        c_new = torch.maximum(self.c, sq_new.amax(dim=1).sqrt())
        if torch.equal(c_new, self.c):
            return
        self.c = c_new
        n = self.n
        self.proj[:, :n] = self._project(self.uk[:, :n], self.sq[:, :n], self.c)

    def _store(self, keys: torch.Tensor) -> None:
        # keys (H, m, D): append points n..n+m-1 (keys, norms, projections)
        m, a = keys.shape[1], self.n
        if a + m > self.cap:
            raise ValueError(f"the DCI tree holds at most {self.cap} keys, {a + m} asked")
        self._layouts = {}  # new points (and maybe new projections): the query layouts are stale
        k = keys.float()
        sq = k.double().square().sum(-1)
        self._grow_norm(sq)
        self.keys[:, a:a + m] = k
        self.sq[:, a:a + m] = sq
        self.uk[:, a:a + m] = k @ self.u[:-1]
        self.proj[:, a:a + m] = self._project(self.uk[:, a:a + m], sq, self.c)

    # -- levels ----------------------------------------------------------------------------------
    def level_ids(self, level: int) -> torch.Tensor:
        ids = self._level_ids.get(level)
        if ids is None:
            ids = self._level_ids[level] = torch.tensor(self.level_lists.get(level, []), dtype=torch.int64)
        return ids

    def _add_to_level(self, t: int, level: int) -> None:
        lst = self.level_lists.setdefault(level, [])
        self.pos_in_level[t] = len(lst)
        lst.append(t)
        self.level[t] = level
        self._level_ids.pop(level, None)

    # -- building (Algorithm 2) --------------------------------------------------------------------
    def build(self, keys: torch.Tensor) -> None:
        """Index keys (H, n, D) into an empty forest: levels, parents, pages."""
        if self.n:
            raise ValueError("build() indexes an empty forest; use insert() to add keys")
        n = keys.shape[1]
        if n == 0:
            return
        self._store(keys)
        levels = levels_of(torch.arange(n), self.first, self.nxt)
        self.level[:n] = levels
        self.top = int(levels.max())
        for level in range(1, self.top + 1):
            ids = (levels == level).nonzero()[:, 0]
            self.pos_in_level[ids] = torch.arange(ids.numel())
            self.level_lists[level] = ids.tolist()
        self.n = n
        for level in range(1, self.top):  # each point's parent: its nearest point one level up
            ids, up = self.level_ids(level), self.level_ids(level + 1)
            for a in range(0, len(ids), 4096):  # bounded temporaries: (H, 4096, n_{l+1})
                chunk = ids[a:a + 4096]
                sim = self._similarity(self.keys[:, chunk], self.sq[:, chunk], up)
                self.parent[:, chunk] = up[sim.argmax(dim=2)]
        for h in range(self.H):
            self._cut_pages(h)

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
    def insert(self, keys: torch.Tensor) -> list[tuple[int, int]]:
        """Insert keys (H, m, D), in token order. Returns the pages touched, as (head, page)."""
        m = keys.shape[1]
        if self.n == 0:  # nothing to insert into yet: the first keys build the tree
            self.build(keys)
            return [(h, p) for h in range(self.H) for p in range(self.n_pages[h])]
        a = self.n
        self._store(keys)
        touched = []
        for t in range(a, a + m):
            level = level_of(t, self.first, self.nxt)
            if level > self.top:
                self._raise_top(t)
                level = self.top
            if level == self.top:
                parent = [-1] * self.H
            else:  # Alg. 4 with k = 1 at level l + 1, exactly
                up = self.level_ids(level + 1)
                sim = self._similarity(self.keys[:, t:t + 1], self.sq[:, t:t + 1], up)  # (H, 1, n_up)
                parent = up[sim[:, 0].argmax(dim=1)].tolist()
            self._add_to_level(t, level)
            self.n = t + 1
            for h in range(self.H):
                self.parent[h, t] = parent[h]
                touched.append((h, self._place(h, t, parent[h])))
        return touched

    def _raise_top(self, t: int) -> None:
        # point t opens level top + 1: the old top level (the root's children) become its
        # children, the root's pages its pages (no token moves), and t becomes the root's child
        old_top = self.level_ids(self.top)
        self.parent[:, old_top] = t
        self._layouts = {}
        for h in range(self.H):
            if -1 in self.open_page[h]:
                self.open_page[h][t] = self.open_page[h].pop(-1)
        self.top += 1

    def _place(self, h: int, t: int, parent: int) -> int:
        # point t of head h into its parent's open page, or a new page when that one is full
        page = self.open_page[h].get(parent)
        if page is None or int(self.fill[h, page]) == self.P:
            page = self.n_pages[h]
            self.n_pages[h] += 1
            self.open_page[h][parent] = page
        slot = int(self.fill[h, page])
        self.fill[h, page] = slot + 1
        self.page_of[h, t], self.slot_of[h, t] = page, slot
        self.page_token[h, page, slot] = t
        return page

    # -- query (Algorithms 3 and 4) ----------------------------------------------------------------
    def _layout(self, level: int, prop: float, fov: int, batch: int) -> tuple:
        """The level's points per head grouped by node (parent), in projection order within one,
        and what the search needs of them that does not depend on the query: order, node_of
        (H, n_l) tree id and node index per position; per node (H, N, padded with empty nodes
        at n_l): start, up (its parent's position on the level above) and the node_windows of
        the closest-`prop` rule. Rebuilt lazily after an insertion or a growth of c (both change
        projections or nodes)."""
        lay = self._layouts.get((level, prop, fov, batch))
        if lay is None:
            ids = self.level_ids(level)
            n_l = ids.numel()
            x = self.proj[:, ids]  # (H, n_l)
            by_proj = x.argsort(dim=1, stable=True)
            par = self.parent[:, ids].gather(1, by_proj)
            by_node = par.argsort(dim=1, stable=True)
            order = ids[by_proj.gather(1, by_node)]  # tree ids (H, n_l)
            par = par.gather(1, by_node)
            starts = torch.ones(self.H, n_l, dtype=torch.bool)
            starts[:, 1:] = par[:, 1:] != par[:, :-1]
            node_of = starts.cumsum(1) - 1  # (H, n_l)
            N = int(node_of[:, -1].max()) + 1
            start = torch.full((self.H, N + 1), n_l)  # the last column collects nothing real
            start.scatter_(1, torch.where(starts, node_of, N), torch.arange(n_l).expand(self.H, n_l))
            start = start[:, :N]
            size = torch.zeros(self.H, N, dtype=torch.int64).scatter_add_(1, node_of, torch.ones_like(node_of))
            up = torch.zeros(self.H, N, dtype=torch.int64)  # the parents' positions one level up
            up.scatter_(1, node_of, self.pos_in_level[par.clamp_min(0)])
            pair_key, m = node_windows(self.proj.gather(1, order), node_of, start, size, prop, fov, batch)
            lay = self._layouts[(level, prop, fov, batch)] = (order, node_of, pair_key, start, up, m)
        return lay

    def candidates(self, q: torch.Tensor, heads: torch.Tensor, fov: int, prop: float, batch: int = CLOSEST):
        """Algorithm 4 with Flag = True: score the keys the tree search visits. q (B, G, D) blocks
        of G queries searching the tree of KV head heads[b] (B,) -> per level, from the top,
        concatenated: ids (B, C) tree ids (-1 pad) and scores (B, G, C) float32, q.k where query g
        scored the key, -inf where it did not (a block's queries share one candidate list, the
        union of what they visit: each key is read once per block)."""
        B, G, D = q.shape
        R = B * G
        qf = q.float()
        twice_pq = 2 * self.query_projection(qf.reshape(R, D)).view(B, G, 1)  # 2 u.T_Q(q)
        same_heads = B == self.H and torch.equal(heads, torch.arange(self.H))  # the policy's case
        ids_out, scores_out = [], []
        expanded = None  # (B, G, n_{l+1} + 1) bool: the fov best points of the level above, by position
        for level in range(self.top, 0, -1):
            layout = self._layout(level, prop, fov, batch)
            if not same_heads:
                layout = tuple(t.index_select(0, heads) for t in layout)
            order, node_of, pair_key, start, up, m = layout  # (B, n_l) x 3, (B, N) x 3
            n_l, N = order.shape[1], start.shape[1]
            # each query's window in each node: the m children its scan scores (visited_per_node),
            # nearest in projection, counted only where the query expanded the node's parent
            lo = window_starts(pair_key, twice_pq, N)  # (B, G, N)
            hi = lo + m[:, None]
            opened = torch.ones(B, G, N, dtype=torch.bool) if expanded is None else \
                expanded.gather(2, up[:, None].expand(B, G, N))
            # the block's candidates: the union of its queries' windows, as +1/-1 at their ends
            ends = torch.zeros(B, n_l + 1, dtype=torch.int64)
            ends.scatter_add_(1, lo.view(B, -1), opened.view(B, -1).long())
            ends.scatter_add_(1, hi.view(B, -1), -opened.view(B, -1).long())
            union = ends[:, :n_l].cumsum(1) > 0  # (B, n_l)
            dest = union.cumsum(1) - 1
            C = int(dest[:, -1].max()) + 1
            if C == 0:
                break
            at = torch.full((B, C + 1), n_l - 1, dtype=torch.int64)  # layout positions of the union
            at.scatter_(1, torch.where(union, dest, C), torch.arange(n_l).expand(B, n_l))
            at = at[:, :C]
            cand = torch.where(torch.arange(C) <= dest[:, -1:], order.gather(1, at), -1)  # tree ids
            node = node_of.gather(1, at)[:, None].expand(B, G, C)  # which query scores which candidate
            mask = opened.gather(2, node) & (lo.gather(2, node) <= at[:, None]) & (at[:, None] < hi.gather(2, node))
            # the fov best of a level are expanded on the next; level 1's are only scored
            scores, best = dci_scores(qf, self.keys, heads, cand, mask, min(fov, C) if level > 1 else 0,
                                      backend=self.backend)
            ids_out.append(cand)
            scores_out.append(scores)
            self.scored += int((opened * m[:, None]).sum())
            if level > 1:
                chosen = cand.gather(1, best.view(B, -1).clamp_min(0)).view(B, G, -1)
                where = torch.where(best >= 0, self.pos_in_level[chosen.clamp_min(0)], n_l)
                expanded = torch.zeros(B, G, n_l + 1, dtype=torch.bool).scatter_(2, where, True)
        self.searched += R * self.n
        return torch.cat(ids_out, dim=1), torch.cat(scores_out, dim=2)

    def top_keys(self, q: torch.Tensor, heads: torch.Tensor, k: int, fov: int | None = None, prop: float = 0.8,
                 batch: int = CLOSEST):
        """The k keys of largest q.k the search finds: q (B, G, D) -> tree ids (B, G, k), -1 pad."""
        ids, scores = self.candidates(q, heads, field_of_view(self.n) if fov is None else fov, prop, batch)
        B, G, C = scores.shape
        if C < k:
            ids = torch.cat((ids, ids.new_full((B, k - C), -1)), 1)
            scores = torch.cat((scores, scores.new_full((B, G, k - C), float("-inf"))), 2)
        best = stable_topk(scores, k)  # (B, G, k)
        found = ids[:, None].expand(B, G, -1).gather(2, best)
        return torch.where(scores.gather(2, best) > float("-inf"), found, -1)

    def select_pages(self, q: torch.Tensor, heads: torch.Tensor, k: int, fov: int | None = None, prop: float = 0.8,
                     batch: int = CLOSEST):
        """Algorithm 3: per query, the first k distinct pages in order of their best scored key,
        i.e. the k pages of largest max q.k over the keys it scored (ties to the lower page).
        q (B, G, D), heads (B,) -> pages (B, G, k) of the block's head, -1 pad."""
        B, G, _ = q.shape
        if self.n == 0:
            return torch.full((B, G, k), -1, dtype=torch.int64)
        ids, scores = self.candidates(q, heads, field_of_view(self.n) if fov is None else fov, prop, batch)
        pages = torch.where(ids >= 0, self.page_of.index_select(0, heads).gather(1, ids.clamp_min(0)), self.max_pages)
        best = torch.full((B, G, self.max_pages + 1), float("-inf"))
        best.scatter_reduce_(2, pages[:, None].expand(B, G, -1), scores, "amax")
        best[:, :, self.max_pages] = float("-inf")
        k_eff = min(k, self.max_pages)
        top = stable_topk(best, k_eff)
        out = torch.where(best.gather(2, top) > float("-inf"), top, -1)
        return out if k_eff == k else torch.cat((out, out.new_full((B, G, k - k_eff), -1)), 2)

    # -- reading ---------------------------------------------------------------------------------
    def page_tokens(self, h: int, page: int) -> list[int]:
        """Tree ids in page `page` of head h, in slot order."""
        return self.page_token[h, page, :int(self.fill[h, page])].tolist()

    def nbytes(self) -> int:
        tensors = (self.keys, self.sq, self.uk, self.proj, self.c, self.level, self.pos_in_level, self.parent,
                   self.page_of, self.slot_of, self.fill, self.page_token)
        return sum(t.numel() * t.element_size() for t in tensors)


def closest_per_node(x: torch.Tensor, twice_pq: torch.Tensor, start: torch.Tensor, size: torch.Tensor, prop: float,
                     ar: torch.Tensor) -> torch.Tensor:
    """DCI's candidate stop with one simple index (m = 1): of each node's children, the
    m = ceil(prop * size) closest to the query in projection. x (B, n_l) projections of the
    points of a block's tree, grouped by node and ascending within one; start, size (B, n_l) of
    each point's node; twice_pq (B, G, 1) twice each query's projection -> keep (B, G, n_l) bool.

    In one dimension the m nearest of a sorted run x_0 <= ... <= x_{s-1} are a window
    [a, a + m), and x_i + x_{i+m} grows with i, so a = #{i < s - m : x_i + x_{i+m} < 2 pq}:
    one gather and a cumulative sum instead of a sort per node."""
    B, G, n_l = twice_pq.shape[0], twice_pq.shape[1], x.shape[1]
    if prop >= 1.0:
        return torch.ones(B, G, n_l, dtype=torch.bool)
    m = torch.ceil(size * prop - 1e-9).long()
    i = ar - start  # position within the node
    pair = x + x.gather(1, (ar + m).clamp_max(n_l - 1))  # x_i + x_{i+m}, per block
    cond = (i < size - m)[:, None] & (pair[:, None] < twice_pq)  # (B, G, n_l)
    cs = cond.cumsum(2)
    last = (start + size - 1)[:, None].expand(B, G, n_l)
    before = cs.gather(2, (start - 1).clamp_min(0)[:, None].expand(B, G, n_l))
    a = cs.gather(2, last) - torch.where(start > 0, 1, 0)[:, None] * before  # window start of each point's node
    i = i[:, None]
    return (i >= a) & (i < a + m[:, None])


def float_order(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [0, 2**32) with the same order (the float's bits, negatives flipped)."""
    bits = (x.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31


def visited_per_node(size: torch.Tensor, prop: float, fov: int = 0, batch: int = 1) -> torch.Tensor:
    """How many of a node's `size` children a query scores, as the authors' M-DCI query does
    with one simple index: all of them when the field of view covers the node (fov >= size);
    otherwise the nearest projections are taken in batches of `batch` (M-DCI's CLOSEST = 128)
    until at least max(fov, ceil(prop size)) are scored (the candidate stop, checked after each
    batch). batch = 1, fov = 0: exactly ceil(prop size), closest_per_node's rule."""
    want = torch.ceil(size * prop - 1e-9).long().clamp_min(fov)
    m = ((want + batch - 1) // batch) * batch
    return torch.where(size <= fov, size, m.minimum(size))


def node_windows(x: torch.Tensor, node_of: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
                 prop: float, fov: int = 0, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """closest_per_node's rule, per node instead of per point, in the part that does not depend
    on the query: x, node_of (H, n_l) projections grouped by node (ascending within one) and each
    point's node index; start, size (H, N) per node -> (pair_key (H, n_l) int64 sorted per row,
    m (H, N) the children each query scores, visited_per_node). A query's window in node j is then [lo, lo + m_j) with lo = searchsorted(pair_key,
    j 2^32 + order(2 pq)): the m nearest of a sorted run x_0 <= ... <= x_{s-1} start at
    a = #{i < s - m : x_i + x_{i+m} < 2 pq} (the pair sums grow with i), and the node index in
    the high bits keeps each node's pair sums apart (i >= s - m get the node's largest key)."""
    H, n_l = x.shape
    m = visited_per_node(size, prop, fov, batch)  # (H, N)
    m_of = m.gather(1, node_of)  # (H, n_l) each point's node's m
    ar = torch.arange(n_l).expand(H, n_l)
    i = ar - start.gather(1, node_of)  # position within the node
    pair = x + x.gather(1, (ar + m_of).clamp_max(n_l - 1))  # x_i + x_{i+m}
    low = torch.where(i < size.gather(1, node_of) - m_of, float_order(pair), 2**32 - 1)
    return node_of * 2**32 + low, m


def window_starts(pair_key: torch.Tensor, twice_pq: torch.Tensor, n_nodes: int) -> torch.Tensor:
    """pair_key (B, n_l) from node_windows, twice_pq (B, G, 1) -> lo (B, G, N): the first layout
    position of each query's window in each node."""
    B, G = twice_pq.shape[:2]
    value = torch.arange(n_nodes) * 2**32 + float_order(twice_pq)  # (B, G, N)
    return torch.searchsorted(pair_key, value.view(B, G * n_nodes)).view(B, G, n_nodes)
