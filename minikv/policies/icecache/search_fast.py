"""The query side of IceCache's DCI tree (dci.py): Algorithms 3 and 4, batched.

IceCache (Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence
LLMs", arXiv:2604.10539, 2026, https://arxiv.org/abs/2604.10539; Algorithms 3-4, Appendix B).

From the top level down, the candidates of a level are the children of the `fov` best points
expanded on the level above (all top-level points at the start). Each node's children are
scanned as the authors' M-DCI scans them with one simple index (m = 1): outward from the query's
projection u.T_Q(q) in the order of |u.T_K(k) - u.T_Q(q)|, in batches of CLOSEST = 128
projections, until max(fov, ceil(prop size)) are scored (the candidate stop, prop_to_retrieve =
0.8, checked after each batch); a node the field of view covers (size <= fov) is scored whole.
So nodes of up to 128 children are scored whole, and the tree prunes by the field of view: only
the children of the fov best points of a level are looked at. (Where M-DCI picks a batch's side
by the next projection, the window here is the m nearest projections; the count is M-DCI's.)
Scoring is exact, by q.k. Field of view max(30, 0.0015 n) as in the authors' code. With
fov >= n every point is scored: the search is exact.

Batched form. The search runs per level on all KV heads and all queries of a block at once. What
does not depend on the query is kept per level until an insertion (LevelLayout): the level's
points grouped by node, in projection order within one, their pages, and per node the window
size m and the pair sums x_i + x_{i+m} (node_windows). Per query and node, the window
start is one searchsorted, and a query's visited points are its windows in the opened nodes.

How the visited keys are scored. With the Triton backend, a block's queries (one KV head's query
heads) share their candidates, the union of what they visit, gathered and scored by
kernels/dci_scores, each key read once per block. The eager path on a CPU multiplies the queries
by every key row of the tree (DCIForest.slot_keys, page by page) in one product instead and masks
what a query does not visit to -inf:
a group's queries visit most of the tree between them (at 8k keys the field of view's 30 nodes
of ~125 children are half of level 1 per query, and the union of a group's three queries two
thirds), and one product over contiguous keys costs less on a CPU than gathering two thirds of
them (about 0.5 against 1.5 ms per layer on SmolLM2 at 8k keys). Either way a query's scores, and the
search's result, are exactly Algorithm 4's: the stats count the keys the search visits.
DCIForest.select_pages takes the eager path's pages from that product without scoring each
level in layout order (dci_pages.py); search_levels is the reference it is tested against.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.dci_scores import dci_scores
from ..kernels.dci_scores.reference import float_order, ranked

CLOSEST = 128  # projections a node's scan scores per step before it checks its stop (M-DCI's CLOSEST)


def field_of_view(n: int) -> int:
    """Points expanded per level at query time: max(30, 0.0015 n) (the authors' query setting)."""
    return max(30, int(n * 1.5e-3))


class LevelLayout(NamedTuple):
    """One level of a forest, per KV head, in the order the search reads it (see build_layout)."""
    order: torch.Tensor  # (H, n_l) tree ids, grouped by node, ascending projection within one
    node_of: torch.Tensor  # (H, n_l) node index of each position
    pair_key: torch.Tensor  # (H, n_l) int64, node_windows
    start: torch.Tensor  # (H, N) first position of each node (n_l for padding nodes)
    up: torch.Tensor  # (H, N) position of the node's parent on the level above
    m: torch.Tensor  # (H, N) children a query scores in the node (visited_per_node)
    page: torch.Tensor  # (H, n_l) the page of each position (a point never changes page)
    col: torch.Tensor  # (H, n_l) the key row of each position (page P + slot, DCIForest.slot_keys)
    in_level: torch.Tensor  # (H, n_l) each position's place in the level list (pos_in_level)
    node_key: torch.Tensor  # (H, N) j 2^32: node j's part of a searchsorted value in pair_key
    pos_info: torch.Tensor  # (H, 3, n_l) each position's node, the position, its node's m (dci_pages)
    sort_key: torch.Tensor  # (H, n_l) int64 the order's key (node_sort_key), ascending
    whole: bool  # every node scored whole (m == size): an opened node needs no window

    def select(self, heads: torch.Tensor) -> "LevelLayout":
        return LevelLayout(*(t.index_select(0, heads) for t in self[:-1]), self.whole)


def build_layout(forest, level: int, prop: float, fov: int, batch: int, base: LevelLayout | None = None,
                 new: torch.Tensor | None = None) -> LevelLayout:
    """The part of a level's search that does not depend on the query (see LevelLayout). base,
    new: the level's layout before the points new (r,) joined it (nothing else changed): their
    order is merged into base's instead of sorting the level again."""
    H = forest.H
    order, sort_key = by_node(forest, forest.level_ids(level)) if base is None else merged_by_node(forest, base, new)
    n_l = order.shape[1]
    par = forest.parent.gather(1, order)
    starts = torch.ones(H, n_l, dtype=torch.bool)
    starts[:, 1:] = par[:, 1:] != par[:, :-1]
    node_of = starts.cumsum(1) - 1  # (H, n_l)
    N = int(node_of[:, -1].max()) + 1
    start = torch.full((H, N + 1), n_l)  # the last column collects nothing real
    start.scatter_(1, torch.where(starts, node_of, N), torch.arange(n_l).expand(H, n_l))
    start = start[:, :N]
    size = torch.zeros(H, N, dtype=torch.int64).scatter_add_(1, node_of, torch.ones_like(node_of))
    up = torch.zeros(H, N, dtype=torch.int64)  # the parents' positions one level up
    up.scatter_(1, node_of, forest.pos_in_level[par.clamp_min(0)])
    pair_key, m = node_windows(forest.proj.gather(1, order), node_of, start, size, prop, fov, batch)
    pos_info = torch.stack((node_of, torch.arange(n_l).expand(H, n_l), m.gather(1, node_of)), 1)
    page = forest.page_of.gather(1, order)
    return LevelLayout(order, node_of, pair_key, start, up, m, page, page * forest.P + forest.slot_of.gather(1, order),
                       forest.pos_in_level[order], (torch.arange(N) * 2**32).expand(H, N), pos_info, sort_key,
                       bool((m == size).all()))


def node_sort_key(forest, ids: torch.Tensor) -> torch.Tensor:
    """(H, n) int64: the parent above the projection's 32 order bits (the layout's order)."""
    return (forest.parent[:, ids] + 1) * 2**32 + float_order(forest.proj[:, ids])


def by_node(forest, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (n,) ascending -> (order (H, n) tree ids by parent, then projection, ties to the older
    point; their sort keys)."""
    key = node_sort_key(forest, ids)
    at = key.argsort(dim=1, stable=True)
    return ids[at], key.gather(1, at)


def merged_by_node(forest, base: LevelLayout, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """by_node of base's points and new (r,) (ids above all of base's), by merging: each new
    point goes after the base points of equal key (they are older), the new ones in by_node order."""
    H, n_old = base.order.shape
    r = new.numel()
    order_new, key_new = by_node(forest, new)
    ins = torch.searchsorted(base.sort_key, key_new, right=True)  # (H, r) base points at or below each
    at = ins + torch.arange(r)  # the new points' final positions
    # a base point moves up by the new points placed before it (those with ins <= its position)
    before = torch.zeros(H, n_old + 1, dtype=torch.int64).scatter_add_(1, ins, torch.ones_like(ins)).cumsum(1)
    old_at = torch.arange(n_old) + before[:, :n_old]
    order = torch.empty(H, n_old + r, dtype=torch.int64).scatter_(1, old_at, base.order).scatter_(1, at, order_new)
    key = torch.empty(H, n_old + r, dtype=torch.int64).scatter_(1, old_at, base.sort_key).scatter_(1, at, key_new)
    return order, key


def visited_points(lay: LevelLayout, twice_pq: torch.Tensor, expanded: torch.Tensor | None):
    """-> ((B, G, n_l) bool: the points each query scores on this level, its window in each node
    it opened; how many that is in all). twice_pq (B, G, 1) twice each query's projection;
    expanded (B, G, n_{l+1} + 1) the points expanded on the level above, by position, or None
    where all were."""
    B, G = twice_pq.shape[:2]
    N, n_l = lay.start.shape[1], lay.order.shape[1]
    lo = window_starts(lay.pair_key, twice_pq, N)  # (B, G, N)
    hi = lo + lay.m[:, None]
    opened = torch.ones(B, G, N, dtype=torch.int32) if expanded is None else \
        expanded.gather(2, lay.up[:, None].expand(B, G, N)).int()
    # +1 at each window's start, -1 past its end: nodes are disjoint runs, so a point is visited
    # where the running sum is 1
    marks = torch.zeros(B, G, n_l + 1, dtype=torch.int32)
    marks.scatter_add_(2, lo, opened).scatter_add_(2, hi, -opened)
    return marks.cumsum(2)[:, :, :n_l] > 0, int((opened * lay.m[:, None]).sum())


def union_candidates(order: torch.Tensor, visit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """order (B, n_l) tree ids, visit (B, G, n_l) -> (cand (B, C) the union of a block's visited
    points in layout order, -1 padded; mask (B, G, C) which query visits which)."""
    B, G, n_l = visit.shape
    union = visit.any(dim=1)  # (B, n_l)
    dest = union.cumsum(1) - 1
    C = int(dest[:, -1].max()) + 1
    at = torch.full((B, C + 1), n_l - 1, dtype=torch.int64)  # layout positions of the union
    at.scatter_(1, torch.where(union, dest, C), torch.arange(n_l).expand(B, n_l))
    at = at[:, :C]
    cand = torch.where(torch.arange(C) <= dest[:, -1:], order.gather(1, at), -1)
    return cand, visit.gather(2, at[:, None].expand(B, G, C))


def product_with_every_row(forest, qf: torch.Tensor, heads: torch.Tensor, same_heads: bool,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """qf (B, G, D) float32 -> (B, G, rows) q.k for every key row of the blocks' heads (empty rows
    0), plus bias (B, 1, rows) if given (in the product's own pass: cheaper than a fill after it)."""
    rows = max(forest.n_pages) * forest.P
    keys = forest.slot_keys[:, :rows] if same_heads else forest.slot_keys.index_select(0, heads)[:, :rows]
    if bias is None:
        return torch.bmm(qf, keys.transpose(1, 2))
    return torch.baddbmm(bias, qf, keys.transpose(1, 2))


def search(forest, q: torch.Tensor, heads: torch.Tensor, fov: int, prop: float, batch: int = CLOSEST,
           dense: bool | None = None):
    """Algorithm 4 with Flag = True: score the keys the tree search visits. q (B, G, D) blocks of
    G queries searching the tree of KV head heads[b] (B,) -> per level, from the top,
    concatenated: ids (B, C) tree ids (-1 pad) and scores (B, G, C) float32, q.k where query g
    scored the key, -inf where it did not. dense: one product with every key, masked (default
    with the eager backend), or the block's union gathered (dci_scores); the same result."""
    levels = list(search_levels(forest, q, heads, fov, prop, batch, dense))
    return torch.cat([ids for ids, _, _ in levels], dim=1), torch.cat([scores for _, _, scores in levels], dim=2)


def search_levels(forest, q: torch.Tensor, heads: torch.Tensor, fov: int, prop: float, batch: int = CLOSEST,
                  dense: bool | None = None):
    """search(), level by level from the top: yields (ids (B, C_l) tree ids, -1 pad; pages (B, C_l)
    their pages, max_pages for the pad; scores (B, G, C_l))."""
    B, G, D = q.shape
    qf = q.float()
    twice_pq = 2 * forest.query_projection(qf.reshape(B * G, D)).view(B, G, 1)  # 2 u.T_Q(q)
    same_heads = B == forest.H and torch.equal(heads, torch.arange(forest.H))  # the policy's case
    every_key = None  # eager: (B, G, rows) q.k for every key row of the tree, page by page
    if forest.backend == "eager" if dense is None else dense:
        every_key = product_with_every_row(forest, qf, heads, same_heads)
    forest.searched += B * G * forest.n
    expanded = None  # (B, G, n_{l+1} + 1) bool by position, the fov best of the level above; None: all
    for level in range(forest.top, 0, -1):
        lay = forest.layout(level, prop, fov, batch)
        if not same_heads:
            lay = lay.select(heads)
        n_l = lay.order.shape[1]
        visit, n_visited = (None, B * G * n_l) if expanded is None and lay.whole else \
            visited_points(lay, twice_pq, expanded)
        forest.scored += n_visited
        # the fov best are expanded on the next level; none to rank where all will be
        all_expanded = visit is None and fov >= n_l
        k = min(fov, n_l) if level > 1 and not all_expanded else 0
        if every_key is not None:  # the level's points in layout order, what a query skips masked
            cand, pages = lay.order, lay.page
            scores = every_key.gather(2, lay.col[:, None].expand(B, G, n_l))
            if visit is not None:
                scores = torch.where(visit, scores, float("-inf"))
            best = ranked(scores, k)
        else:
            cand, mask = union_candidates(lay.order, torch.ones(B, G, n_l, dtype=torch.bool) if visit is None else visit)
            pages = torch.where(cand >= 0, forest.page_of.index_select(0, heads).gather(1, cand.clamp_min(0)),
                                forest.max_pages)
            slots = forest.slot_of.index_select(0, heads).gather(1, cand.clamp_min(0))
            rows = torch.where(cand >= 0, pages * forest.P + slots, -1)
            scores, best = dci_scores(qf, forest.slot_keys, heads, rows, mask, min(k, cand.shape[1]),
                                      backend=forest.backend)
        yield cand, pages, scores
        if level > 1:
            if all_expanded:
                expanded = None
            else:
                chosen = cand.gather(1, best.view(B, -1).clamp_min(0)).view(B, G, -1)
                where = torch.where(best >= 0, forest.pos_in_level[chosen.clamp_min(0)], n_l)
                expanded = torch.zeros(B, G, n_l + 1, dtype=torch.bool).scatter_(2, where, True)


# -- one node's window (the candidate stop of one simple index) ------------------------------------

def visited_per_node(size: torch.Tensor, prop: float, fov: int = 0, batch: int = 1) -> torch.Tensor:
    """How many of a node's `size` children a query scores, as the authors' M-DCI query does
    with one simple index: all of them when the field of view covers the node (fov >= size);
    otherwise the nearest projections are taken in batches of `batch` (M-DCI's CLOSEST = 128)
    until at least max(fov, ceil(prop size)) are scored (the candidate stop, checked after each
    batch). batch = 1, fov = 0: exactly ceil(prop size), closest_per_node's rule."""
    want = torch.ceil(size * prop - 1e-9).long().clamp_min(fov)
    m = ((want + batch - 1) // batch) * batch
    return torch.where(size <= fov, size, m.minimum(size))


def closest_per_node(x: torch.Tensor, twice_pq: torch.Tensor, start: torch.Tensor, size: torch.Tensor, prop: float,
                     ar: torch.Tensor) -> torch.Tensor:
    """DCI's candidate stop with one simple index (m = 1): of each node's children, the
    m = ceil(prop * size) closest to the query in projection. x (B, n_l) projections of the
    points of a block's tree, grouped by node and ascending within one; start, size (B, n_l) of
    each point's node; twice_pq (B, G, 1) twice each query's projection -> keep (B, G, n_l) bool.
    (The definition node_windows is tested against.)

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


def node_windows(x: torch.Tensor, node_of: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
                 prop: float, fov: int = 0, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """closest_per_node's rule, per node instead of per point, in the part that does not depend
    on the query: x, node_of (H, n_l) projections grouped by node (ascending within one) and each
    point's node index; start, size (H, N) per node -> (pair_key (H, n_l) int64 sorted per row,
    m (H, N) the children each query scores, visited_per_node). A query's window in node j is
    then [lo, lo + m_j) with lo = searchsorted(pair_key, j 2^32 + order(2 pq)): the m nearest of
    a sorted run x_0 <= ... <= x_{s-1} start at a = #{i < s - m : x_i + x_{i+m} < 2 pq} (the
    pair sums grow with i), and the node index in the high bits keeps each node's pair sums
    apart (i >= s - m get the node's largest key)."""
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
