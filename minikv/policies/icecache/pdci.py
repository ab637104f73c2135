"""icecache:paper's search: several P-DCI indices per tree, Algorithm 4's descent as written, and
the union of a GQA group's pages.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Sec. 3.3, App. B).
P-DCI: Li and Malik, "Fast k-Nearest Neighbour Search via Prioritized DCI", ICML 2017,
https://arxiv.org/abs/1703.00440 (Algorithm 2 there, the query).

`descent=greedy` (icecache:paper) runs this module instead of search.py and its batched forms
(`gqa=union` its merge_union instead of search.merge_group):

  P-DCI on one node         candidates() (the parents' queries; query() applies it to every
                            opened node at once): L composite indices of m simple indices each, each simple
                            index a random direction. A priority queue pops, per composite, the
                            projection nearest the query's among the m simple indices; a point is
                            a candidate of composite l once popped from all m of them, and
                            composite l stops once it has want = max(k, ceil(prop size))
                            candidates. The pops come in order of |u_j.(T(x) - T(q))|, so a point
                            joins at its aggregated lower bound max_j |u_j.(T(x) - T(q))| and the
                            candidates of composite l are the `want` points of smallest bound
                            (ties to the earlier point). The union over l is scored exactly and
                            the node returns its k best.
  Algorithm 4, QUERY        S = {root}; per level, S' = the union of each node's k best; P (a
                            priority queue of size k) takes S' on every level (Flag, l = -1) or
                            on the target level only; S <- S'. query(): page selection, Flag, k =
                            the field of view; PDCIForest._greedy_parents: a point's parent (Alg.
                            1 line 34, Alg. 2), k = 1, a greedy path from the root down to the
                            level above the point.
  FIND-PAGE-INDEX           search.find_page_index over P's keys
  GQA (Sec. 4.2)            merge_union(): "the union of the selected pages across queries within
                            the same group" (gqa=union, which icecache:paper selects with either descent)

Decisions (docs/design.md, "The paper as a preset"): the directions are drawn once and shared by
all layers and heads (the first is the default's u); the parent is looked for one level above the
point (App. B.1), and where the greedy path reaches a point with no children before that level
(the pseudo-code would return nothing) the exact nearest point of that level is taken.
"""
from __future__ import annotations

import math

import torch

from .search import ROOT, field_of_view, find_page_index
from .tree import DCIForest


class PDCIForest(DCIForest):
    """A DCIForest whose parents come from the paper's QUERY(k, T, l + 1, 1) over L composite
    indices of m simple indices (U (L m, D + 1), composite l the rows l m .. l m + m - 1)."""

    def __init__(self, *, U: torch.Tensor, simple: int, composite: int, prop: float, **kwargs):
        super().__init__(u=U[0], **kwargs)
        if U.shape[0] != simple * composite:
            raise ValueError(f"U holds {U.shape[0]} directions, simple * composite = {simple * composite}")
        self.U, self.m, self.L, self.prop = U.float(), simple, composite, prop
        self.uk_all = torch.zeros(self.H, self.cap, U.shape[0])  # U[:, :D].k of every point

    def _store(self, keys: torch.Tensor) -> None:
        a, m = self.n, keys.shape[1]
        super()._store(keys)
        self.uk_all[:, a:a + m] = keys.float() @ self.U[:, :-1].T

    def key_projections(self, h: int, ids: torch.Tensor) -> torch.Tensor:
        """U.T_K(k) (n, L m) of head h's points ids (n,) at the current c (Eq. 2)."""
        c = max(float(self.c[h]), 1e-30)
        tail = (c * c - self.sq[h, ids]).clamp_min(0).sqrt()  # sqrt(c^2 - |k|^2), float64
        return ((self.uk_all[h, ids].double() + self.U[:, -1].double() * tail[:, None]) / c).float()

    def query_projections(self, q: torch.Tensor) -> torch.Tensor:
        """U.T_Q(q) (R, L m) for q (R, D) (Eq. 3)."""
        q = q.float()
        return (q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)

    def similarity(self, h: int, x: torch.Tensor, sq_x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sim(x, k) (r, n) of keys x (r, D) with norms sq_x (r,) and head h's points ids (n,):
        larger is nearer under T_K (the key-to-key distance of the parents)."""
        c2 = float(self.c[h]) ** 2
        tail = (c2 - sq_x).clamp_min(0).sqrt()[:, None] * (c2 - self.sq[h, ids]).clamp_min(0).sqrt()[None]
        return x.float() @ self.keys_of(h, ids).T + tail.float()

    def keys_of(self, h: int, ids: torch.Tensor) -> torch.Tensor:
        # during build the points have no page yet: their keys come from build's argument
        return self._building[h, ids].float() if self._building is not None else self.head_keys(h, ids)

    # -- parents: QUERY(k_i, T, l_i + 1, 1), a greedy descent ----------------------------------
    _building: torch.Tensor | None = None

    def _build_parents(self, keys: torch.Tensor) -> None:
        self._building = keys
        try:
            for level in range(self.top - 1, 0, -1):  # top down: a level's parents need the levels above
                run = self.level_ids(level)
                self.parent[:, run] = self._greedy_parents(level, keys[:, run], run)
        finally:
            self._building = None

    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
        return self._greedy_parents(level, keys, run)

    def _greedy_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
        # the points run (r,) of `level`, keys (H, r, D), their norms stored: parents (H, r) on level + 1
        out = torch.empty(self.H, run.numel(), dtype=torch.int64)
        for h in range(self.H):
            px = self.key_projections(h, run)  # (r, L m): each point is its own query
            node = torch.full((run.numel(),), ROOT, dtype=torch.int64)  # S = {root}
            lost = torch.zeros(run.numel(), dtype=torch.bool)  # the path reached a point with no children
            for up in range(self.top, level, -1):
                ids = self.level_ids(up)
                par = self.parent[h, ids]
                nxt = torch.full_like(node, ROOT)
                for s in node[~lost].unique().tolist():
                    children = ids[par == s]
                    every = ((node == s) & ~lost).nonzero()[:, 0]
                    if children.numel() == 0:
                        lost[every] = True
                        continue
                    for who in every.split(2048):  # bounded temporaries: (2048, children, L m)
                        self._step(h, who, children, px, keys, run, nxt)
                node = nxt
            if bool(lost.any()):  # the exact nearest point of level + 1 instead
                target = self.level_ids(level + 1)
                sim = self.similarity(h, keys[h, lost], self.sq[h, run[lost]], target)
                node[lost] = target[sim.argmax(dim=1)]
            out[h] = node
        return out

    def _step(self, h, who, children, px, keys, run, nxt) -> None:
        # one P-DCI step of the descent (k = 1) for the points who, all in the node of `children`
        cand = candidates(px[who], self.key_projections(h, children), 1, self.prop, self.m, self.L)
        sim = self.similarity(h, keys[h, who], self.sq[h, run[who]], children)
        nxt[who] = children[sim.masked_fill(~cand, -math.inf).argmax(dim=1)]  # k = 1: its nearest candidate


def candidates(pq: torch.Tensor, px: torch.Tensor, k: int, prop: float, m: int, L: int) -> torch.Tensor:
    """P-DCI's candidates in one node: queries' projections pq (r, L m), the node's points' px
    (s, L m) -> (r, s) bool: a point is a candidate when, in some composite l, it is among the
    want = max(k, ceil(prop s)) points of smallest aggregated bound max_j |px_j - pq_j|."""
    r, s = pq.shape[0], px.shape[0]
    want = max(k, math.ceil(prop * s - 1e-9))
    if want >= s:
        return torch.ones(r, s, dtype=torch.bool)
    bound = (px[None] - pq[:, None]).abs().view(r, s, L, m).amax(dim=3)  # (r, s, L): the bound per composite
    rank = bound.argsort(dim=1, stable=True).argsort(dim=1)  # each point's place in composite l's pops
    return (rank < want).any(dim=2)


def rank_in_node(node: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Each element's rank within its node (node (c,) int64 >= 0) by ascending key (c,), ties to
    the earlier element: one stable sort of node + key mapped monotonically into [0, 1)."""
    k = key.double()
    lo, span = (k.min(), k.max() - k.min() + 1) if k.numel() else (0.0, 1.0)
    order = (node.double() * 2 + (k - lo) / span).argsort(stable=True)  # by node, then key
    counts = torch.bincount(node)
    start = counts.cumsum(0) - counts  # each node's first place in the order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel()) - start[node[order]]
    return rank


def query(forest: PDCIForest, q: torch.Tensor, h: int, k: int, prop: float) -> dict[int, float]:
    """Algorithm 4 with l = -1 (Flag = True): query q (D,) on head h's tree -> P, {tree id: q.k}
    for the k best keys of all levels' S', best first."""
    q = q.float()
    pq = forest.query_projections(q[None])  # (1, L m)
    opened = torch.tensor([ROOT])  # S
    best = torch.zeros(0, dtype=torch.int64)  # P: its tree ids and their scores
    best_score = torch.zeros(0)
    for level in range(forest.top, 0, -1):
        ids = forest.level_ids(level)  # ascending tree id
        par = forest.parent[h, ids]
        inside = torch.isin(par, opened)
        ids, par = ids[inside], par[inside]  # the children of the nodes in S, by tree id
        if ids.numel() == 0:
            break
        node = torch.searchsorted(opened.sort().values, par)  # node index of each child
        size = torch.bincount(node, minlength=opened.numel())
        want = (prop * size.double() - 1e-9).ceil().long().clamp_min(k)  # P-DCI's stop per node
        bound = (forest.key_projections(h, ids) - pq).abs().view(-1, forest.L, forest.m).amax(dim=2)  # (c, L)
        cand = torch.zeros(ids.numel(), dtype=torch.bool)
        for l in range(forest.L):  # composite l's candidates: the want smallest bounds of each node
            cand |= rank_in_node(node, bound[:, l]) < want[node]
        ids, node = ids[cand], node[cand]
        scores = forest.head_keys(h, ids) @ q  # exact q.k of the candidates
        forest.scored += ids.numel()
        top = rank_in_node(node, -scores) < k  # each node's k best: S''
        ids, scores = ids[top], scores[top]  # S', by tree id
        best, best_score = torch.cat((best, ids)), torch.cat((best_score, scores))  # P <- P + S'
        order = best.argsort()
        order = order[(-best_score[order]).argsort(stable=True)][:k]
        best, best_score = best[order], best_score[order]  # P holds the k best, ties to the older
        opened = ids
    forest.searched += forest.n
    return dict(zip(best.tolist(), best_score.tolist()))


def page_lists(forest: PDCIForest, q: torch.Tensor, k: int, fov: int | None, prop: float) -> list[list[list[int]]]:
    """Algorithm 3 for each query head: q (Hq, D), query head j on KV head j // G -> per KV head,
    per query head, its first k distinct pages in order of their best key in P."""
    fov = field_of_view(forest.n) if fov is None else fov
    G = q.shape[0] // forest.H
    return [[find_page_index(forest, h, query(forest, q[h * G + g], h, fov, prop), k) for g in range(G)]
            for h in range(forest.H)]


def merge_union(lists: list[list[int]], k: int) -> list[int]:
    """GQA as the paper writes it (Sec. 4.2): "the union of the selected pages across queries
    within the same group", in order of first appearance (query head 0's pages, then each next
    head's new ones), -1 padded to k slots; the caller gives each head few enough pages to fit."""
    union = list(dict.fromkeys(page for pages in lists for page in pages if page >= 0))
    if len(union) > k:
        raise ValueError(f"the union of the group's pages holds {len(union)}, more than its {k} slots")
    return union + [-1] * (k - len(union))
