"""Algorithm 3's page choice on the page-major key rows: the eager (CPU) path of select_pages.

IceCache (Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence
LLMs", arXiv:2604.10539, 2026, https://arxiv.org/abs/2604.10539; Algorithms 3-4).

A query's pages are the k pages of largest max q.k over the keys its search scored (ties to the
lower page; dci.DCIForest.select_pages). The reference way (dci_search.search_levels) scores each
level's visited points in layout order and scatters their maxima into pages. Here the same answer
comes from the index's rows, which are stored page by page (DCIForest.slot_keys: row c P + s is
page c's slot s):

  1. S = q . every row, one product (B, G, rows); a page's P scores are adjacent.
  2. The descent of Algorithm 4 (levels from the top, the field of view) needs only the upper
     levels' scores, which are few: it gives, per query and node of every level, the window of
     layout positions the query scores there, [lo, lo + m), or none (a node not opened).
  3. Upper bound: the max of a page's P scores, visited or not, is at least its visited max. The
     C = 3k pages of largest bound are candidates; their visited max is exact (each row knows its
     level's node and layout position: visited iff lo <= position < lo + m). If the k-th best
     exact value beats the best bound outside the candidates, no other page can enter: the answer
     is exact. Otherwise (rare: the search skipped most of the best pages) every page is
     computed the same way.

So a step touches each row once in the product and in one max over P adjacent scores, and
per-point work (gathers, masks) only for 3k pages, not for the whole tree: on SmolLM2 at 8k keys
the per-point post-processing of the reference path costs more than the product itself.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import torch

from .dci_search import product_with_every_row

CANDIDATE_PAGES = 3  # candidates per selected page (C = 3 k); on SmolLM2 at 8k keys 2 k never failed the check
NOT_OPENED = 2**40  # window start of a node a query does not open: no position reaches it


class SlotMap(NamedTuple):
    """Per key row (H, rows), rows = the most pages of any head x P, for one set of search
    parameters: what the visited test of a row needs, kept until a layout changes."""
    info: torch.Tensor  # (H, 3, rows) int64: the row's node (numbered across levels from the top;
    #                     n_nodes for an empty row), its position in its level's layout, and its
    #                     node's window size m (LevelLayout.m)
    empty_bias: torch.Tensor  # (H, 1, rows) float32: -inf for a slot that holds no key, else 0
    n_nodes: int

    def select(self, heads: torch.Tensor) -> "SlotMap":
        return SlotMap(self.info.index_select(0, heads), self.empty_bias.index_select(0, heads), self.n_nodes)


def build_slot_map(forest, layouts) -> SlotMap:
    """layouts: the LevelLayouts of levels top .. 1 -> SlotMap."""
    H, P = forest.H, forest.P
    rows = max(forest.n_pages) * P
    info = torch.zeros(H, 3, rows, dtype=torch.int64)
    node, pos, m = info.unbind(1)
    node.fill_(-1)
    offset = 0
    for lay in layouts:
        n_l = lay.order.shape[1]
        node.scatter_(1, lay.col, lay.node_of + offset)
        pos.scatter_(1, lay.col, torch.arange(n_l).expand(H, n_l))
        m.scatter_(1, lay.col, lay.m.gather(1, lay.node_of))
        offset += lay.start.shape[1]
    empty = node < 0
    node[empty] = offset
    return SlotMap(info, torch.zeros(H, 1, rows).masked_fill_(empty[:, None], float("-inf")), offset)


def window_starts_per_level(forest, S: torch.Tensor, twice_pq: torch.Tensor, layouts, fov: int) -> torch.Tensor:
    """Algorithm 4's descent. S (B, G, rows) scores of every row; twice_pq (B, G, 1); layouts of
    levels top .. 1 (the blocks' heads) -> lo (B, G, n_nodes + 1): per query and node, numbered
    as in SlotMap, the first layout position its window scores, NOT_OPENED where the query does
    not open the node (and for the empty rows' node). Counts the scored keys (forest.scored)."""
    B, G = twice_pq.shape[:2]
    order_pq = None  # float_order(2 pq), for the window starts (dci_search.window_starts)
    expanded = None  # (B, G, n_{l+1} + 1) bool by position in level list; None: all expanded
    starts = []
    for i, lay in enumerate(layouts):
        level = len(layouts) - i
        N, n_l = lay.start.shape[1], lay.order.shape[1]
        every_point = expanded is None and lay.whole
        if every_point:
            lo = lay.start[:, None].expand(B, G, N)
            forest.scored += B * G * n_l
        else:
            order_pq = few_float_orders(twice_pq) if order_pq is None else order_pq
            lo = torch.searchsorted(lay.pair_key, (lay.node_key[:, None] + order_pq).view(B, G * N)).view(B, G, N)
            if expanded is not None:
                opened = expanded.gather(2, lay.up[:, None].expand(B, G, N))
                lo = lo.masked_fill_(~opened, NOT_OPENED)
                forest.scored += int((opened * lay.m[:, None]).sum())
            else:
                forest.scored += G * int(lay.m.sum())
        starts.append(lo)
        if level == 1:
            break
        if every_point and fov >= n_l:
            expanded = None  # the field of view covers the level: every point expanded
            continue
        scores = S.gather(2, lay.col[:, None].expand(B, G, n_l))  # the level in layout order
        if not every_point:
            scores.masked_fill_(~in_window(lay.pos_info[:, None], lo), float("-inf"))
        # the fov best it scored (ties to the lower layout position) are expanded on the next level
        top = scores.sort(dim=2, descending=True, stable=True)
        k = min(fov, n_l)
        chosen = lay.in_level[:, None].expand(B, G, n_l).gather(2, top.indices[..., :k])  # by position in level
        chosen.masked_fill_(top.values[..., :k] == float("-inf"), n_l)
        expanded = torch.zeros(B, G, n_l + 1, dtype=torch.bool).scatter_(2, chosen, True)
    starts.append(torch.full((B, G, 1), NOT_OPENED))
    return torch.cat(starts, 2)


def few_float_orders(x: torch.Tensor) -> torch.Tensor:
    """float_order of a few values (a block's queries), on Python numbers: for nine values one
    pass over a list costs less than float_order's seven tensor operations."""
    bits = [int.from_bytes(struct.pack("<f", v + 0.0), "little", signed=True) for v in x.reshape(-1).tolist()]
    return torch.tensor([(b ^ 0x7FFFFFFF if b < 0 else b) + 2**31 for b in bits], dtype=torch.int64).view(x.shape)


def in_window(info: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """info (..., 3, X) each row's node, layout position and window size m; lo (B, G, n_nodes + 1)
    -> (B, G, X) bool: the query scores the row (lo <= position < lo + m, lo its node's)."""
    B, G = lo.shape[:2]
    node, pos, m = info.unbind(-2)
    d = pos - lo.gather(2, node.expand(B, G, -1))
    return (d >= 0) & (d < m)


def visited_page_max(S: torch.Tensor, lo: torch.Tensor, sm: SlotMap, pages: torch.Tensor, P: int) -> torch.Tensor:
    """S (B, G, rows), lo (B, G, n_nodes + 1), pages (B, G, C) -> (B, G, C) each page's max q.k
    over the keys the query scored, -inf where none."""
    B, G, C = pages.shape
    rows = (pages[..., None] * P + torch.arange(P)).view(B, G, 1, C * P)
    info = sm.info[:, None].expand(B, G, 3, -1).gather(3, rows.expand(B, G, 3, C * P))  # (B, G, 3, C P)
    scores = torch.where(in_window(info, lo), S.gather(2, rows.view(B, G, C * P)), float("-inf"))
    return page_max(scores, P)


def page_max(scores: torch.Tensor, P: int) -> torch.Tensor:
    """scores (B, G, n P) -> (B, G, n) the max of each run of P (a max pool: on a CPU some 3x
    faster than amax over a trailing dim of 16)."""
    B, G, X = scores.shape
    return torch.nn.functional.max_pool1d(scores.view(B * G, 1, X), P).view(B, G, X // P)


def select_pages_dense(forest, q: torch.Tensor, heads: torch.Tensor, k: int, fov: int, prop: float, batch: int,
                       candidates: int = CANDIDATE_PAGES):
    """q (B, G, D), heads (B,), or None for every head in order -> (B, G, k) the pages of the k
    largest max q.k over the keys each query's search scores, ties to the lower page, -1 pad (see
    the module docstring)."""
    B, G, D = q.shape
    P = forest.P
    qf = q.float()
    same_heads = heads is None or (B == forest.H and torch.equal(heads, torch.arange(forest.H)))
    layouts, sm = forest.search_layouts(prop, fov, batch)
    if not same_heads:
        layouts, sm = [lay.select(heads) for lay in layouts], sm.select(heads)
    twice_pq = 2 * forest.query_projection(qf.reshape(B * G, D)).view(B, G, 1)  # 2 u.T_Q(q)
    # (B, G, rows); empty slots -inf (never visited), added in the product: q.k + 0 is q.k
    S = product_with_every_row(forest, qf, heads, same_heads, sm.empty_bias)
    forest.searched += B * G * forest.n
    lo = window_starts_per_level(forest, S, twice_pq, layouts, fov)
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
        forest.exhaustive_choices += 1
    every = torch.arange(n_pages).expand(B, G, n_pages)
    return finish(*best_pages(visited_page_max(S, lo, sm, every, P), every, k), k)


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
