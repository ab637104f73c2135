"""IceCache's query, the readable form: Algorithms 3 and 4 as loops over levels and nodes.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Appendix B.2).

The authors' search (M-DCI), the default's, as `icecache:backend=reference` runs it; the default
backends run it batched (search_fast.py, pages_fast.py; tests/policies/test_dci.py holds them to
these loops: the same keys scored, the same pages). Algorithm 4 as the paper writes it, over
several P-DCI indices, is pdci.py (`descent=greedy`, which `icecache:paper` selects).

  Algorithm 4, QUERY          query(): from the top level down, scan every node opened on the
                              level above, score the scanned keys exactly (q.k), open the nodes of
                              the fov best of the level (the paper: each node's k best, S <- S');
                              with l = -1 (Flag = True) every scored key is kept
  P-DCI on one node           scan_node(): one simple index (m = L = 1), outward from the query's
                              projection, `batch` projections at a time, until max(fov, ceil(prop
                              size)) children are scanned (the 80% stop); a node the field of view
                              covers is read whole
  Algorithm 3, PAGE-SELECT    page_lists(): QUERY, then FIND-PAGE-INDEX (find_page_index), per
                              query head
  GQA (Sec. 4.2)              merge_group(): the group's page lists round-robin, first k distinct
                              (the authors' code); the paper's union (gqa=union): pdci.merge_union

Decisions (docs/design.md, "icecache"; the authors' M-DCI where the paper is silent): field of
view max(30, 0.0015 n); batches of CLOSEST = 128 projections; pages in order of their best scored
key. Ties go to the earlier point in (parent, projection, insertion) order, to the nearer side
left of the query's projection, and to the lower page: the fast forms break them the same way.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from itertools import chain, zip_longest

import torch

CLOSEST = 128  # projections a node's scan takes before it checks its stop (M-DCI's CLOSEST)
ROOT = -1  # the parent of the top level's points


def field_of_view(n: int) -> int:
    """Points expanded per level at query time: max(30, 0.0015 n) (the authors' query setting)."""
    return max(30, int(n * 1.5e-3))


def scan_node(x: list[float], pq: float, fov: int, prop: float, batch: int) -> tuple[int, int]:
    """Prioritized DCI on one node with one simple index (m = 1): x the children's projections
    u.T_K(k), ascending; pq the query's u.T_Q(q) -> the scanned run x[lo:hi]."""
    size = len(x)
    if size <= fov:  # the field of view covers the node: every child is scored
        return 0, size
    want = max(fov, math.ceil(prop * size - 1e-9))  # the stop: prop_to_retrieve = 0.8 of the node
    lo = hi = bisect_left(x, pq)  # two cursors, left and right of the query's projection
    while hi - lo < want:  # the stop is checked after each batch
        for _ in range(min(batch, size - (hi - lo))):  # take the nearer projection; ties to the left
            if lo == 0 or (hi < size and x[hi] - pq < pq - x[lo - 1]):
                hi += 1
            else:
                lo -= 1
    return lo, hi


def query(tree, q: torch.Tensor, h: int, fov: int | None = None, prop: float = 0.8,
          batch: int = CLOSEST) -> dict[int, float]:
    """Algorithm 4 with l = -1 (Flag = True): query q (D,) on KV head h's tree -> {tree id: q.k}
    for every key the search scored, on every level."""
    fov = field_of_view(tree.n) if fov is None else fov
    q = q.float()
    pq = float(tree.query_projection(q[None])[0])  # u.T_Q(q), Eq. 3
    scored: dict[int, float] = {}
    opened = [ROOT]  # S: the nodes to scan on this level (at the top, the root)
    for level in range(tree.top, 0, -1):
        ids = tree.level_ids(level)
        parents = tree.parent[h, ids]
        on_level = []  # S': the points scanned on this level, node by node
        for node in sorted(opened):
            children = ids[parents == node]  # ascending tree id
            children = children[tree.proj[h, children].argsort(stable=True)].tolist()  # by projection
            lo, hi = scan_node(tree.proj[h, children].tolist(), pq, fov, prop, batch)
            on_level += children[lo:hi]
        scores = (tree.head_keys(h, torch.tensor(on_level, dtype=torch.int64)) @ q).tolist()  # exact q.k
        scored.update(zip(on_level, scores))
        best = sorted(range(len(on_level)), key=lambda i: -scores[i])[:fov]  # stable: ties to the earlier
        opened = [on_level[i] for i in best]  # their children are scanned on the level below
    return scored


def find_page_index(tree, h: int, scored: dict[int, float], k: int) -> list[int]:
    """FIND-PAGE-INDEX: the first k distinct pages of head h in order of their best scored key
    (the authors' code: pages in order of best-token distance), ties to the lower page."""
    pages = tree.page_of[h, list(scored)].tolist()
    best: dict[int, float] = {}
    for page, score in zip(pages, scored.values()):
        best[page] = max(best.get(page, -math.inf), score)
    return sorted(best, key=lambda page: (-best[page], page))[:k]


def merge_group(lists: list[list[int]], k: int) -> list[int]:
    """GQA: the page lists of one group's query heads interleaved round-robin (round j takes
    every head's j-th page), the first k distinct kept, -1 padded: a KV head reads k pages, not
    G k (the authors' `first_k_unique`)."""
    rounds = zip_longest(*lists, fillvalue=-1)  # round j: every head's j-th page
    merged = [page for page in dict.fromkeys(chain.from_iterable(rounds)) if page >= 0][:k]  # first of each
    return merged + [-1] * (k - len(merged))


def page_lists(tree, q: torch.Tensor, k: int, fov: int | None = None, prop: float = 0.8,
               batch: int = CLOSEST) -> list[list[list[int]]]:
    """Algorithm 3 for each query head: q (Hq, D), query head j searching KV head j // G -> per KV
    head, per query head of its group, its first k distinct pages."""
    G = q.shape[0] // tree.H
    return [[find_page_index(tree, h, query(tree, q[h * G + g], h, fov, prop, batch), k) for g in range(G)]
            for h in range(tree.H)]
