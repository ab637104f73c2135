"""FIND-PAGE-INDEX on the page-major key rows: the eager (CPU) default of IceCache's page choice.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Algorithms 3-4).

The reference is search.py (query, then find_page_index): a query's pages are the k of largest
max q.k over the keys its search scored, ties to the lower page. This fast form gets the same
pages (tests/policies/test_dci.py) from the index's rows, stored page by page
(DCIForest.slot_keys: row c P + s is page c's slot s):

  1. S = q . every row, one product (B, G, rows); a page's P scores are adjacent.
  2. search_fast.descend, scoring each level from S, gives per query and node the window of
     layout positions it scores, [lo, lo + m), or none (a node not opened).
  3. Upper bound: the max of a page's P scores, visited or not, is at least its visited max. The
     C = 3k pages of largest bound are candidates; their visited max is exact (a row is visited
     iff lo <= its layout position < lo + m; a page's keys share one parent, so lo and m are
     the page's, and only the positions are gathered per row). If the k-th best exact value
     beats the best bound outside the candidates, no other page can enter; otherwise every page
     of a node the query opened is computed (the others hold no key it scored).

So each row is touched once in the product and once in a max over P adjacent scores; per-point
work (gathers, masks) only for 3k pages. PageSearch keeps, beside search_fast.FastSearch's
layouts, each row's SlotMap, and stores the tree's key rows transposed (see its docstring).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import LevelLayout
from .search_fast import NOT_OPENED, FastSearch, descend, visited

CANDIDATE_PAGES = 3  # candidate pages per selected page (C = 3 k)


class SlotMap(NamedTuple):
    """Per key row (H, rows), rows = the most pages of any head x P, for one set of search
    parameters: what the visited test of a row needs, kept until a layout changes. A page's keys
    share one parent, so the node and its window size are the page's; only the position is the
    row's."""
    pos: torch.Tensor  # (H, rows) int64: the row's position in its level's layout (0 if empty)
    page_node: torch.Tensor  # (H, 2, rows / P) int64: each page's node (numbered across levels
    #                          from the top; n_nodes for a page that holds no key), and that
    #                          node's window size m (LevelLayout.m; 0 for none)
    empty_bias: torch.Tensor  # (H, 1, rows) float32: -inf for a slot that holds no key, else 0
    n_nodes: int

    def select(self, heads: torch.Tensor) -> "SlotMap":
        return SlotMap(*(t.index_select(0, heads) for t in self[:-1]), self.n_nodes)


class PageSearch(FastSearch):
    """FastSearch for select_pages: also the rows' SlotMap per set of search parameters, kept
    until a layout changes. It stores the tree's key rows transposed, (H, D, rows) seen as (H,
    rows, D): the product with every row is then a plain (G, D) x (D, rows) GEMM over
    contiguous rows. The tree reads and writes its rows by index, whatever their strides."""

    def __init__(self, forest):
        super().__init__(forest, "eager")
        keys = forest.slot_keys  # (H, rows, D)
        forest.slot_keys = keys.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, rows' D apart
        self._searches: dict[tuple, tuple[list[LevelLayout], SlotMap, int]] = {}  # (prop, fov, batch) -> kept, n
        self.exhaustive_choices = 0  # times select_pages's candidate bound failed

    def search_layouts(self, prop: float, fov: int, batch: int) -> tuple[list[LevelLayout], SlotMap]:
        """The layouts of levels top .. 1 and the rows' SlotMap, kept while the tree holds as
        many points (every change of the tree inserts some)."""
        kept = self._searches.get((prop, fov, batch))
        if kept is None or kept[2] != self.forest.n:
            layouts = self.layouts(prop, fov, batch)
            kept = self._searches[(prop, fov, batch)] = layouts, build_slot_map(self.forest, layouts), self.forest.n
        return kept[:2]

    def prepare(self, prop, fov, batch):
        self.search_layouts(prop, fov, batch)

    def select_pages(self, q, heads, k, fov, prop, batch, candidates: int = CANDIDATE_PAGES):
        return select_pages(self, q, heads, k, fov, prop, batch, candidates)

    def nbytes(self) -> int:
        kept = [t for _, sm, _ in self._searches.values() for t in sm[:-1]]
        return super().nbytes() + sum(t.numel() * t.element_size() for t in kept)


def fast_search(forest, backend: str) -> FastSearch:
    """The batched search for a tree: eager (a CPU), one product with every row (PageSearch);
    otherwise gathered keys scored by kernels/dci_scores (search_fast.FastSearch)."""
    return PageSearch(forest) if backend == "eager" else FastSearch(forest, backend)


def build_slot_map(forest, layouts) -> SlotMap:
    """layouts: the LevelLayouts of levels top .. 1 -> SlotMap."""
    H, P = forest.H, forest.P
    rows = max(forest.n_pages) * P
    node = torch.full((H, rows), -1, dtype=torch.int64)
    pos = torch.zeros(H, rows, dtype=torch.int64)
    m = torch.zeros(H, rows, dtype=torch.int64)
    offset = 0
    for lay in layouts:
        n_l = lay.order.shape[1]
        node.scatter_(1, lay.col, lay.node_of + offset)
        pos.scatter_(1, lay.col, torch.arange(n_l).expand(H, n_l))
        m.scatter_(1, lay.col, lay.m.gather(1, lay.node_of))
        offset += lay.start.shape[1]
    empty = node < 0
    node[empty] = offset
    page_node = torch.stack((node[:, ::P], m[:, ::P]), 1)  # slot 0 of every page holds a key
    return SlotMap(pos, page_node, torch.zeros(H, 1, rows).masked_fill_(empty[:, None], float("-inf")), offset)


def product_with_every_row(forest, qf: torch.Tensor, heads: torch.Tensor, same_heads: bool,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """qf (B, G, D) float32 -> (B, G, rows) q.k for every key row of the blocks' heads (empty rows
    0), plus bias (B, 1, rows) if given (in the product's own pass: cheaper than a fill after it)."""
    rows = max(forest.n_pages) * forest.P
    keys = forest.slot_keys[:, :rows] if same_heads else forest.slot_keys.index_select(0, heads)[:, :rows]
    if bias is None:
        return torch.bmm(qf, keys.transpose(1, 2))
    return torch.baddbmm(bias, qf, keys.transpose(1, 2))


def window_starts_from_rows(forest, S: torch.Tensor, twice_pq: torch.Tensor, layouts, fov: int) -> torch.Tensor:
    """search_fast.descend with each level's scores taken from S (B, G, rows) -> lo (B, G,
    n_nodes + 1): per query and node (numbered as in SlotMap), its window start, NOT_OPENED
    where it does not open the node (and for the empty rows' node)."""
    B, G = twice_pq.shape[:2]

    def score(i, lay, lo):  # the level's scores in layout order, what a query skips -inf
        n_l = lay.order.shape[1]
        s = S.gather(2, lay.col[:, None].expand(B, G, n_l))
        return s.masked_fill_(~visited(lay, lo), float("-inf"))

    starts = [lo for _, lo, _ in descend(forest, twice_pq, layouts, fov, score)]
    return torch.cat(starts + [torch.full((B, G, 1), NOT_OPENED)], 2)


def visited_page_max(S: torch.Tensor, lo: torch.Tensor, sm: SlotMap, pages: torch.Tensor, P: int) -> torch.Tensor:
    """S (B, G, rows), lo (B, G, n_nodes + 1), pages (B, G, C) -> (B, G, C) each page's max q.k
    over the keys the query scored, -inf where none: a row is scored iff lo <= its position <
    lo + m, lo and m its page's node's (search_fast.in_window, per page)."""
    B, G, C = pages.shape
    n_pages = sm.page_node.shape[2]
    node, m = sm.page_node[:, None].expand(B, G, 2, n_pages).gather(3, pages[:, :, None].expand(B, G, 2, C)).unbind(2)
    lo = lo.gather(2, node)[..., None]  # (B, G, C, 1)
    # the pages' P rows: rows of (B n_pages, P) and (B G n_pages, P) views, one index_select each
    pos = sm.pos.view(B * n_pages, P).index_select(0, (pages + torch.arange(B)[:, None, None] * n_pages).view(-1))
    scores = S.view(B * G * n_pages, P).index_select(0, (pages + torch.arange(B * G).view(B, G, 1) * n_pages).view(-1))
    d = pos.view(B, G, C, P) - lo
    scored = (d >= 0) & (d < m[..., None])
    return page_max(torch.where(scored, scores.view(B, G, C, P), float("-inf")).view(B, G, C * P), P)


def page_max(scores: torch.Tensor, P: int) -> torch.Tensor:
    """scores (B, G, n P) -> (B, G, n) the max of each run of P (a max pool: on a CPU some 3x
    faster than amax over a trailing dim of 16)."""
    B, G, X = scores.shape
    return torch.nn.functional.max_pool1d(scores.view(B * G, 1, X), P).view(B, G, X // P)


def select_pages(ps: PageSearch, q: torch.Tensor, heads: torch.Tensor | None, k: int, fov: int, prop: float,
                 batch: int, candidates: int = CANDIDATE_PAGES) -> torch.Tensor:
    """search_fast.select_pages from one product with every row (see the module docstring):
    q (B, G, D), heads (B,) or None for every head in order -> (B, G, k) pages, -1 pad."""
    B, G, D = q.shape
    forest = ps.forest
    P = forest.P
    qf = q.float()
    heads = torch.arange(forest.H) if heads is None else heads
    same_heads = B == forest.H and torch.equal(heads, torch.arange(forest.H))  # the policy's case
    layouts, sm = ps.search_layouts(prop, fov, batch)  # kept until the tree changes
    if not same_heads:
        layouts, sm = [lay.select(heads) for lay in layouts], sm.select(heads)
    twice_pq = 2 * forest.query_projection(qf.reshape(B * G, D)).view(B, G, 1)  # 2 u.T_Q(q)
    # (B, G, rows); empty slots -inf (never visited), added in the product: q.k + 0 is q.k
    S = product_with_every_row(forest, qf, heads, same_heads, sm.empty_bias)
    forest.searched += B * G * forest.n
    lo = window_starts_from_rows(forest, S, twice_pq, layouts, fov)
    n_pages = S.shape[2] // P
    bound = page_max(S, P)  # a page's best key, visited or not: >= its visited max
    C = min(n_pages, candidates * k)
    if C < n_pages:
        top = bound.topk(C + 1, dim=2)  # any order among equal bounds: only the values matter below
        cand = top.indices[..., :C].sort(dim=2).values  # by page, for the ties
        outside = top.values[..., C:]  # the best bound left out
        pages, values = best_pages(visited_page_max(S, lo, sm, cand, P), cand, k)
        if k <= C and bool(((outside < values[..., -1:]) | (outside == float("-inf"))).all()):
            return finish(pages, values, k)
        ps.exhaustive_choices += 1
    # every page of a node the query opened (the others hold no key it scored), exactly
    opened = lo.gather(2, sm.page_node[:, None, 0].expand(B, G, n_pages)) != NOT_OPENED  # (B, G, n_pages)
    cand = bound.masked_fill_(~opened, float("-inf")).topk(int(opened.sum(2).max()), dim=2).indices.sort(dim=2).values
    return finish(*best_pages(visited_page_max(S, lo, sm, cand, P), cand, k), k)


def best_pages(values: torch.Tensor, pages: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values, pages (B, G, C), pages ascending -> (pages, values) (B, G, min(k, C)): the k
    largest values, ties to the lower page (a stable sort)."""
    top = values.sort(dim=2, descending=True, stable=True)
    k = min(k, values.shape[2])
    return pages.gather(2, top.indices[..., :k]), top.values[..., :k]


def finish(pages: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """-1 where no key was scored, padded with -1 to k."""
    out = pages.masked_fill(values == float("-inf"), -1)
    if out.shape[2] < k:
        out = torch.cat((out, out.new_full((*out.shape[:2], k - out.shape[2]), -1)), 2)
    return out
