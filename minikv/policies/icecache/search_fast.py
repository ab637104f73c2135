"""IceCache's query batched (fast form of search.py): Algorithm 4's descent over every KV head
and query of a step at once.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Algorithms 3-4).

search.py is the reference: read it first. This module computes the same thing for blocks of G
queries (B, G, D), block b searching KV head heads[b]'s tree, and is tested to score the same
keys (tests/policies/test_dci.py):

  a node's scan (search.scan_node)    layout.py's visited_per_node (how many) and node_windows
                                      (where): the m children nearest the query's projection are a
                                      window [a, a + m) of the node's sorted run, found by one
                                      searchsorted
  the levels (search.query's loop)    descend(): the one batched descent, shared by search() and
                                      pages_fast.select_pages; what does not depend on the query
                                      is kept per level until an insertion (layout.py: LevelLayout)
  FIND-PAGE-INDEX                     select_pages(): each level's scores into page maxima

How the visited keys are scored is the caller's: here the union of a block's visited keys is
gathered and scored by kernels/dci_scores (the Triton backend's way; each key read once per
block); pages_fast.py (the eager default on a CPU) multiplies by every key row at once instead.
FastSearch holds what these forms keep beside a tree (the layouts), and reads off the tree when
they are stale; the tree (tree.py) knows nothing of it but that it is told of a build.
"""
from __future__ import annotations

import struct

import torch

from ...kernels.dci_scores import dci_scores
from ...kernels.dci_scores.reference import float_order, stable_topk
from .layout import LevelLayout, build_layout, window_starts
from .search import CLOSEST, field_of_view

NOT_OPENED = 2**40  # window start of a node a query does not open: no position reaches it


class FastSearch:
    """The batched search beside one DCIForest: per level and search parameters the part that
    does not depend on the query (a LevelLayout), kept until the tree changes, which it reads off
    the tree (`fresh`): a growth of c or a new top level changes every projection or the top's
    parents, and everything is built again; points that joined a level since (the tail of its
    list) are merged into the kept order. After a build (DCIForest.watchers) the search named by
    `params` is prepared (`built`). backend: kernels/dci_scores' backend for the gathered keys."""

    def __init__(self, forest, backend: str = "eager"):
        self.forest, self.backend = forest, backend
        self._layouts: dict[tuple, LevelLayout] = {}  # (level, prop, fov, batch) -> its layout
        self._seen = None  # (c, top) of the tree the kept layouts were built on
        self.params = None  # (prop, fov or None, batch): the search to prepare once the tree is built
        forest.watchers.append(self)

    def built(self) -> None:
        """The tree was built (build.py, at prefill): what the next search needs is built now."""
        if self.params is not None:
            prop, fov, batch = self.params
            self.prepare(prop, field_of_view(self.forest.n) if fov is None else fov, batch)

    def fresh(self) -> None:
        """Drop every kept layout if c grew or a level opened since they were built."""
        seen = (self.forest.c.clone(), self.forest.top)
        if self._seen is None or seen[1] != self._seen[1] or not torch.equal(seen[0], self._seen[0]):
            self._layouts, self._seen = {}, seen

    def layout(self, level: int, prop: float, fov: int, batch: int) -> LevelLayout:
        """build_layout's result, kept; after points joined the level and nothing else changed,
        they are merged into the kept one's order."""
        self.fresh()
        key = (level, prop, fov, batch)
        lay, ids = self._layouts.get(key), self.forest.level_ids(level)
        if lay is None or ids.numel() > lay.order.shape[1]:  # new, or points joined the level since
            lay = self._layouts[key] = build_layout(self.forest, level, prop, fov, batch, lay,
                                                    None if lay is None else ids[lay.order.shape[1]:])
        return lay

    def layouts(self, prop: float, fov: int, batch: int) -> list[LevelLayout]:
        """The layouts of levels top .. 1."""
        return [self.layout(level, prop, fov, batch) for level in range(self.forest.top, 0, -1)]

    def select_pages(self, q: torch.Tensor, heads: torch.Tensor | None, k: int, fov: int, prop: float,
                     batch: int) -> torch.Tensor:
        return select_pages(self, q, heads, k, fov, prop, batch)

    def prepare(self, prop: float, fov: int, batch: int) -> None:
        """Build what the next search needs now (after a prefill, with the tree)."""
        self.layouts(prop, fov, batch)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lay in self._layouts.values() for t in lay[:-1])


def few_float_orders(x: torch.Tensor) -> torch.Tensor:
    """float_order of a few values (a block's queries), on Python numbers: for nine values one
    pass over a list costs less than float_order's seven tensor operations."""
    bits = [int.from_bytes(struct.pack("<f", v + 0.0), "little", signed=True) for v in x.reshape(-1).tolist()]
    return torch.tensor([(b ^ 0x7FFFFFFF if b < 0 else b) + 2**31 for b in bits], dtype=torch.int64).view(x.shape)


def in_window(info: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """info (..., 3, X) each point's node, layout position and window size m; lo (B, G, nodes)
    -> (B, G, X) bool: the query scores the point (lo <= position < lo + m, lo its node's)."""
    B, G = lo.shape[:2]
    node, pos, m = info.unbind(-2)
    d = pos - lo.gather(2, node.expand(B, G, -1))
    return (d >= 0) & (d < m)


def visited(lay: LevelLayout, lo: torch.Tensor) -> torch.Tensor:
    """lo (B, G, N) window starts on level lay -> (B, G, n_l) bool: the query scores the point
    (in_window). On a level whose nodes are all read whole (lay.whole) that is whether the
    point's node is opened: one gather instead of the window test."""
    if lay.whole:
        return (lo != NOT_OPENED).gather(2, lay.node_of[:, None].expand(*lo.shape[:2], -1))
    return in_window(lay.pos_info[:, None], lo)


def descend(forest, twice_pq: torch.Tensor, layouts: list[LevelLayout], fov: int, score):
    """Algorithm 4's levels, batched: twice_pq (B, G, 1) twice each query's u.T_Q(q); layouts of
    levels top .. 1 (the blocks' heads); score(i, lay, lo) -> (B, G, n_l) the q.k of level i (of
    layouts) in layout order, -inf where a query does not visit. Yields per level (lay, lo, scores): lo (B, G, N)
    each query's window start in each node, NOT_OPENED where it does not open the node; scores
    where the descent needed them to choose the fov best (else None). Counts forest.scored."""
    B, G = twice_pq.shape[:2]
    order_pq = few_float_orders(twice_pq)
    expanded = None  # (B, G, n_{l+1} + 1) bool by place in the level above; None: every point
    for i, lay in enumerate(layouts):
        N, n_l = lay.start.shape[1], lay.order.shape[1]
        every_point = expanded is None and lay.whole  # every node opened and read whole
        if every_point:
            lo = lay.start[:, None].expand(B, G, N)
            forest.scored += B * G * n_l
        else:  # the window starts, one searchsorted per node (node_windows)
            lo = window_starts(lay.pair_key, lay.node_key, order_pq)
            if expanded is None:
                forest.scored += G * int(lay.m.sum())
            else:  # only the children of the points expanded on the level above
                opened = expanded.gather(2, lay.up[:, None].expand(B, G, N))
                lo = torch.where(opened, lo, NOT_OPENED)
                forest.scored += int((opened * lay.m[:, None]).sum())
        if i == len(layouts) - 1 or (every_point and fov >= n_l):
            yield lay, lo, None  # the last level, or the field of view covers it: nothing to rank
            expanded = None
            continue
        scores = score(i, lay, lo)
        yield lay, lo, scores
        # the fov best it scored (ties to the lower layout position) are expanded on the next level
        top = scores.sort(dim=2, descending=True, stable=True)
        k = min(fov, n_l)
        chosen = lay.in_level[:, None].expand(B, G, n_l).gather(2, top.indices[..., :k])  # by place in level
        chosen.masked_fill_(top.values[..., :k] == float("-inf"), n_l)
        expanded = torch.zeros(B, G, n_l + 1, dtype=torch.bool).scatter_(2, chosen, True)


def gathered_scores(fs: FastSearch, qf: torch.Tensor, heads: torch.Tensor, lay: LevelLayout, lo: torch.Tensor) -> torch.Tensor:
    """descend's score(): the union of a block's visited points gathered and scored once for
    the block (kernels/dci_scores) -> (B, G, n_l) q.k in layout order, -inf where not visited."""
    B, G = qf.shape[:2]
    n_l = lay.order.shape[1]
    visit = visited(lay, lo)  # (B, G, n_l)
    union = visit.any(dim=1)  # (B, n_l)
    dest = union.cumsum(1) - 1
    C = int(dest[:, -1].max()) + 1
    at = torch.full((B, C + 1), n_l, dtype=torch.int64)  # layout positions of the union, n_l pads
    at.scatter_(1, torch.where(union, dest, C), torch.arange(n_l).expand(B, n_l))
    at = at[:, :C]
    rows = torch.where(at < n_l, lay.col.gather(1, at.clamp_max(n_l - 1)), -1)  # key rows
    mask = visit.gather(2, at.clamp_max(n_l - 1)[:, None].expand(B, G, C)) & (at < n_l)[:, None]
    scores, _ = dci_scores(qf, fs.forest.slot_keys, heads, rows, mask, 0, backend=fs.backend)
    out = torch.full((B, G, n_l + 1), float("-inf")).scatter_(2, at[:, None].expand(B, G, C), scores)
    return out[..., :n_l]


def blocks(fs: FastSearch, q: torch.Tensor, heads: torch.Tensor | None, prop: float, fov: int, batch: int):
    """-> (heads (B,), the layouts of levels top .. 1 for those heads, twice_pq (B, G, 1))."""
    B, G, D = q.shape
    forest = fs.forest
    heads = torch.arange(forest.H) if heads is None else heads
    layouts = fs.layouts(prop, fov, batch)
    if not (B == forest.H and torch.equal(heads, torch.arange(forest.H))):
        layouts = [lay.select(heads) for lay in layouts]
    twice_pq = 2 * forest.query_projection(q.float().reshape(B * G, D)).view(B, G, 1)  # 2 u.T_Q(q)
    return heads, layouts, twice_pq


def search(fs: FastSearch, q: torch.Tensor, heads: torch.Tensor | None, fov: int, prop: float = 0.8,
           batch: int = CLOSEST):
    """search.query for blocks: q (B, G, D) -> ids (B, C) tree ids of every level from the top,
    layout order, and scores (B, G, C) float32, q.k where the query scored the key, else -inf."""
    forest = fs.forest
    heads, layouts, twice_pq = blocks(fs, q, heads, prop, fov, batch)
    qf = q.float()
    forest.searched += q.shape[0] * q.shape[1] * forest.n
    score = lambda i, lay, lo: gathered_scores(fs, qf, heads, lay, lo)  # noqa: E731
    levels = [(lay.order, score(i, lay, lo) if s is None else s)  # every level's scores, the last's too
              for i, (lay, lo, s) in enumerate(descend(forest, twice_pq, layouts, fov, score))]
    return torch.cat([ids for ids, _ in levels], 1), torch.cat([s for _, s in levels], 2)


def top_keys(fs: FastSearch, q: torch.Tensor, heads: torch.Tensor | None, k: int, fov: int | None = None,
             prop: float = 0.8, batch: int = CLOSEST) -> torch.Tensor:
    """The k keys of largest q.k the search scores: q (B, G, D) -> tree ids (B, G, k), -1 pad."""
    ids, scores = search(fs, q, heads, field_of_view(fs.forest.n) if fov is None else fov, prop, batch)
    B, G, C = scores.shape
    if C < k:
        ids = torch.cat((ids, ids.new_full((B, k - C), -1)), 1)
        scores = torch.cat((scores, scores.new_full((B, G, k - C), float("-inf"))), 2)
    best = stable_topk(scores, k)  # (B, G, k)
    found = ids[:, None].expand(B, G, -1).gather(2, best)
    return torch.where(scores.gather(2, best) > float("-inf"), found, -1)


def select_pages(fs: FastSearch, q: torch.Tensor, heads: torch.Tensor | None, k: int, fov: int, prop: float = 0.8,
                 batch: int = CLOSEST) -> torch.Tensor:
    """search.find_page_index for blocks: q (B, G, D) -> (B, G, k) the pages of the k largest
    max q.k over the keys each query scored, ties to the lower page, -1 pad."""
    B, G, _ = q.shape
    forest = fs.forest
    heads, layouts, twice_pq = blocks(fs, q, heads, prop, fov, batch)
    qf = q.float()
    forest.searched += B * G * forest.n
    score = lambda i, lay, lo: gathered_scores(fs, qf, heads, lay, lo)  # noqa: E731
    best = torch.full((B, G, forest.max_pages + 1), float("-inf"))  # per page, its best scored key
    for i, (lay, lo, scores) in enumerate(descend(forest, twice_pq, layouts, fov, score)):
        scores = score(i, lay, lo) if scores is None else scores
        best.scatter_reduce_(2, lay.page[:, None].expand(B, G, -1), scores, "amax")
    k_eff = min(k, forest.max_pages)
    top = stable_topk(best[..., :forest.max_pages], k_eff)
    out = torch.where(best.gather(2, top) > float("-inf"), top, -1)
    return out if k_eff == k else torch.cat((out, out.new_full((B, G, k - k_eff), -1)), 2)
