"""IceCache's batched search, the part that does not depend on the query: each level of a forest
laid out in the order the search reads it (LevelLayout), and the closed form of search.scan_node's
window per node (visited_per_node, node_windows). search_fast.py holds the descent that reads them.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Algorithms 3-4).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ...kernels.dci_scores.reference import float_order


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
    pos_info: torch.Tensor  # (H, 3, n_l) each position's node, the position, its node's m (in_window)
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


# -- one node's window (search.scan_node, per node and in closed form) ---------------------------

def visited_per_node(size: torch.Tensor, prop: float, fov: int = 0, batch: int = 1) -> torch.Tensor:
    """How many of a node's `size` children a query scores, as the authors' M-DCI query does
    with one simple index: all of them when the field of view covers the node (fov >= size);
    otherwise the nearest projections are taken in batches of `batch` (M-DCI's CLOSEST = 128)
    until at least max(fov, ceil(prop size)) are scored (the candidate stop, checked after each
    batch): search.scan_node's count, in closed form."""
    want = torch.ceil(size * prop - 1e-9).long().clamp_min(fov)
    m = ((want + batch - 1) // batch) * batch
    return torch.where(size <= fov, size, m.minimum(size))


def node_windows(x: torch.Tensor, node_of: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
                 prop: float, fov: int = 0, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """search.scan_node's window, in the part that does not depend on the query: x, node_of
    (H, n_l) projections grouped by node (ascending within one) and each point's node index; start, size (H, N) per node -> (pair_key (H, n_l) int64 sorted per row,
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
    xd = x.double()  # two float32 add exactly in float64
    pair = round_down(xd + xd.gather(1, (ar + m_of).clamp_max(n_l - 1)))  # x_i + x_{i+m}
    low = torch.where(i < size.gather(1, node_of) - m_of, float_order(pair), 2**32 - 1)
    return node_of * 2**32 + low, m


def round_down(s: torch.Tensor) -> torch.Tensor:
    """float64 -> the largest float32 <= s: then s < t iff round_down(s) < t for every float32 t
    (2 pq is one), so the pair sums compare as exactly as search.scan_node's distances do."""
    f = s.float()
    return torch.where(f.double() > s, torch.nextafter(f, torch.tensor(float("-inf"))), f)


def window_starts(pair_key: torch.Tensor, node_key: torch.Tensor, order_pq: torch.Tensor) -> torch.Tensor:
    """pair_key (B, n_l) from node_windows, node_key (B, N) = node index 2^32, order_pq (B, G, 1)
    float_order(2 pq) -> lo (B, G, N): the first layout position of each query's window per node."""
    B, G, N = order_pq.shape[0], order_pq.shape[1], node_key.shape[1]
    return torch.searchsorted(pair_key, (node_key[:, None] + order_pq).view(B, G * N)).view(B, G, N)
