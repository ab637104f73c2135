"""icecache:paper against IceCache's Algorithms 1, 2, 3 and 4, transcribed here step by step
independently of the library: own float64 arithmetic, own tree, own P-DCI (a priority queue over
sorted simple indices, as Li and Malik 2017 write it), own pages.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, https://arxiv.org/abs/2604.10539; P-DCI: Li and Malik, ICML 2017,
https://arxiv.org/abs/1703.00440.

What the transcription shares with the library is the documented spec of its random draws (so
that the same tree can be grown): the promotion stream of layer l is
random.Random(f"icecache/{seed}/{l}"), one point after another in insertion order, and the m L
projection directions are m L draws of randn(D + 1) in float64, in turn from
torch.Generator().manual_seed(seed), each normalised, stored in float32. The rest is the paper's, or docs/design.md's named decisions
where the paper leaves a point open ("The paper as a preset"):

  Alg. 1    the decode loop: the oldest window page leaves before the append (lines 16-17), pages
            are selected (22) and attention runs (25) before the page's tokens are inserted (26-36)
  Alg. 1 l.29-33, Alg. 2   random promotion, "while Random(0, 1) < r"; build removes empty levels
            and inserts top level first; a parent is QUERY(k, T, l + 1, 1), the nearest point one
            level up (App. B.1) found by a k = 1 descent, the exact nearest where the path ends
            at a point with no children; c is the largest key norm indexed (the page being
            inserted included); a point drawn above the top opens one new level, adopting the old
            top level and the root's open page
  pages     a node's children, by projection on the first direction at build, cut into pages of
            s; an inserted point goes to its parent's last page, a new one when it is full
  Alg. 4    QUERY: S = {root}; per level S' = the union of each node's k best P-DCI results,
            P (size k) takes S' on every level (Flag); k = the field of view max(30, 0.0015 n)
  Alg. 3    FIND-PAGE-INDEX: pages in order of their best key in P, K // G per query head; GQA:
            the union over the group's query heads (Sec. 4.2)

  minikv    while no tree holds more than K pages, every page is read (nothing to choose)

The tests compare, at every step and layer, what each KV head reads, the attention output and
the number of keys the page queries scored (P-DCI's candidates: the union over the composite
indices, which any change of a projection moves), and the trees (levels, parents, pages as token
sets) after the prefill and at the end."""
import bisect
import heapq
import math
import random
from typing import NamedTuple

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make
from minikv.policies.icecache.counts import tree_page

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                  n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=4096, rotary_dim=8)
P, SINK, WINDOW, K = 4, 4, 8, 4  # pages of 4 tokens; 4 retrieved pages per KV head, 2 per query head
SPEC = (f"icecache:paper,page_size={P},sink={SINK},window={WINDOW},budget={SINK + WINDOW + K * P},skip_layers=0,"
        "backend=reference")
SEED, R, M_SIMPLE, L_COMP, PROP = 0, 0.01, 4, 2, 0.8  # the preset's values, written out here
ROOT = "root"


def directions(D, J, seed):
    """The documented draw of the projection directions (J, D + 1), as float64 of their float32."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(J):
        u = torch.randn(D + 1, generator=g, dtype=torch.float64)
        out.append((u / u.norm()).float().double().tolist())
    return out


def dot(a, b):
    return math.fsum(x * y for x, y in zip(a, b))


class Tree:
    """One KV head's DCI tree (Alg. 2 and the insert), with its pages, in plain Python."""

    def __init__(self, U, stream, r):
        self.U, self.stream, self.r = U, stream, r
        self.key, self.level, self.parent = [], [], []  # per tree id
        self.children = {}  # node (ROOT or a tree id) -> its children, by tree id
        self.pages, self.open = [], {}  # pages: lists of tree ids; node -> index of its last page
        self.c, self.top = 0.0, 0
        self.scored = 0  # keys the page queries scored exactly (P-DCI's candidates)

    # Eqs. 2-3, the MIPS transform
    def t_key(self, k):
        return [x / self.c for x in k] + [math.sqrt(max(0.0, 1 - dot(k, k) / self.c ** 2))]

    def t_query(self, q):
        norm = math.sqrt(dot(q, q))
        return [x / norm for x in q] + [0.0]

    # P-DCI (Li and Malik 2017, Algorithm 2) in one node, then its k best
    def pdci(self, tq, node, k, score, scoring):
        points = self.children.get(node, [])
        want = max(k, math.ceil(PROP * len(points) - 1e-9))
        if want >= len(points):
            cands = set(points)
        else:
            proj = {x: [dot(u, self.t_key(self.key[x])) for u in self.U] for x in points}
            pq = [dot(u, tq) for u in self.U]
            cands = set()
            for comp in range(L_COMP):
                heap, cursors, count, found = [], {}, {}, set()
                for j in range(comp * M_SIMPLE, (comp + 1) * M_SIMPLE):  # simple index j: points by projection
                    index = sorted((proj[x][j], x) for x in points)
                    at = bisect.bisect_left([p for p, _ in index], pq[j])
                    cursors[j] = [index, at - 1, at]  # the next point left, the next right
                    self._push(heap, j, cursors[j], pq[j])
                while len(found) < want:  # pop the nearest projection of any simple index
                    _, j, x = heapq.heappop(heap)
                    self._push(heap, j, cursors[j], pq[j])
                    count[x] = count.get(x, 0) + 1
                    if count[x] == M_SIMPLE:  # seen in all m simple indices of the composite
                        found.add(x)
                cands |= found
        self.scored += len(cands) if scoring else 0  # a page query (a parent query is not counted)
        return sorted(cands, key=lambda x: (-score(x), x))[:k]

    @staticmethod
    def _push(heap, j, cursor, pqj):
        index, left, right = cursor
        options = []
        if left >= 0:
            options.append((pqj - index[left][0], "L"))
        if right < len(index):
            options.append((index[right][0] - pqj, "R"))
        if not options:
            return
        gap, side = min(options)
        x = index[left][1] if side == "L" else index[right][1]
        cursor[1 if side == "L" else 2] += -1 if side == "L" else 1
        heapq.heappush(heap, (gap, j, x))

    # Alg. 4
    def query(self, tq, target, k, score, flag):
        S, P = [ROOT], []
        for level in range(self.top, target - 1, -1):
            S_ = [x for s in S for x in self.pdci(tq, s, k, score, scoring=flag)]
            if flag or level == target:
                P = sorted(set(P) | set(S_), key=lambda x: (-score(x), x))[:k]
            S = S_
        return P

    def find_parent(self, t, level):
        """QUERY(k_t, T, l + 1, 1): the point one level up nearest t under T_K."""
        kt = self.t_key(self.key[t])
        dist = lambda x: -math.fsum((a - b) ** 2 for a, b in zip(kt, self.t_key(self.key[x])))  # noqa: E731
        found = self.query(kt, level + 1, 1, dist, flag=False)
        if not found:  # the path ended at a point with no children: the exact nearest
            found = [max((x for x in range(len(self.key)) if self.level[x] == level + 1 and x != t),
                         key=lambda x: (dist(x), -x))]
        return found[0]

    def draw_level(self):
        level = 1
        while self.stream.random() < self.r:
            level += 1
        return level

    def _adopt(self, t, node):
        self.parent[t] = node
        self.children.setdefault(node, []).append(t)

    def build(self, keys):  # Alg. 2
        if not keys:
            return
        self.key = [list(k) for k in keys]
        self.c = max(math.sqrt(dot(k, k)) for k in self.key)
        drawn = [self.draw_level() for _ in keys]
        present = sorted(set(drawn))  # "Remove the empty levels"
        self.level = [present.index(lv) + 1 for lv in drawn]
        self.parent = [None] * len(keys)
        self.top = len(present)
        for level in range(self.top, 0, -1):  # top down: a parent is one level up
            for t in (t for t in range(len(keys)) if self.level[t] == level):
                self._adopt(t, ROOT if level == self.top else self.find_parent(t, level))
        for node, kids in self.children.items():  # pages: by projection on the first direction
            order = sorted(kids, key=lambda x: (dot(self.U[0], self.t_key(self.key[x])), x))
            for a in range(0, len(order), P):
                self.pages.append(order[a:a + P])
            self.open[node] = len(self.pages) - 1
            self.children[node] = sorted(kids)

    def insert(self, keys):  # Alg. 1 lines 26-36, the page's tokens in order
        if not self.key:  # the first keys build the tree (Alg. 2)
            return self.build(keys)
        self.c = max([self.c] + [math.sqrt(dot(k, k)) for k in keys])
        for k in keys:
            t = len(self.key)
            self.key.append(list(k))
            self.parent.append(None)
            level = self.draw_level()
            if level > self.top:  # a new top level: t adopts the old top and the root's open page
                for x in self.children.pop(ROOT, []):
                    self._adopt(x, t)
                if ROOT in self.open:
                    self.open[t] = self.open.pop(ROOT)
                self.top += 1
                level = self.top
            self.level.append(level)
            node = ROOT if level == self.top else self.find_parent(t, level)
            self._adopt(t, node)
            if node in self.open and len(self.pages[self.open[node]]) < P:
                self.pages[self.open[node]].append(t)
            else:
                self.pages.append([t])
                self.open[node] = len(self.pages) - 1

    def select(self, q, k):
        """Alg. 3: QUERY(q, T, -1, fov), then the first k distinct pages by their best key."""
        fov = max(30, int(len(self.key) * 1.5e-3))
        score = lambda x: dot(q, self.key[x])  # noqa: E731
        best = self.query(self.t_query(q), 1, fov, score, flag=True)
        page_of = {t: i for i, page in enumerate(self.pages) for t in page}
        chosen = []
        for x in best:
            if page_of[x] not in chosen:
                chosen.append(page_of[x])
        return chosen[:k]


class PaperLayer:
    """Algorithm 1 for one layer (its trees, one per KV head, sharing the promotion stream). While
    no tree has more than K pages, every page is read (minikv's: nothing to choose)."""

    def __init__(self, layer, G, r=R):
        self.G, self.n_sink, self.n_window = G, SINK // P, WINDOW // P
        self.left = self.indexed = 0  # pages that left the window; of them, those in the tree
        stream = random.Random(f"icecache/{SEED}/{layer}")
        self.U = directions(CFG.head_dim, M_SIMPLE * L_COMP, SEED)
        self.trees = [Tree(self.U, stream, r) for _ in range(CFG.n_kv_heads)]
        self.stream = stream

    def leaves(self, n):
        """Lines 16-17 for the token that makes the length n."""
        return n % P == 0 and n > self.n_sink * P and n // P - (self.n_sink + self.left) >= self.n_window

    def prefill(self, k, v):
        self.K, self.V = k.double(), v.double()
        for n in range(1, k.shape[1] + 1):
            self.left += self.leaves(n)
        self.indexed = self.left
        self._grow(lambda tree, keys: tree.build(keys))  # lines 6-10

    def _grow(self, step):
        # the heads' trees share one promotion stream: head h draws its points' levels in turn, so
        # it is replayed per head (the draws of a point do not depend on the head)
        first, a, b = self.n_sink * P, self.tree_size(), self.indexed * P
        state = self.stream.getstate()
        for h, tree in enumerate(self.trees):
            self.stream.setstate(state)
            step(tree, self.K[h, first + a:first + b].tolist())

    def tree_size(self):
        return len(self.trees[0].key)

    def decode(self, q, k, v):
        n = self.K.shape[1] + 1
        if self.leaves(n):  # lines 16-17
            self.left += 1
        self.K = torch.cat((self.K, k.double()[:, None]), 1)  # line 20
        self.V = torch.cat((self.V, v.double()[:, None]), 1)
        first, q = self.n_sink * P, q.double()
        out, reads = torch.empty_like(q), []
        search = max(len(tree.pages) for tree in self.trees) > K
        for h, tree in enumerate(self.trees):
            pages = [] if search else list(range(len(tree.pages)))
            for g in range(self.G if search else 0):  # line 22 per query head, the group's union (Sec. 4.2)
                for page in tree.select(q[h * self.G + g].tolist(), K // self.G):
                    if page not in pages:
                        pages.append(page)
            in_pages = [first + t for page in pages for t in tree.pages[page]]
            tokens = sorted(set(range(min(n, first))) | set(in_pages) | set(range((self.n_sink + self.left) * P, n)))
            reads.append(set(tokens))
            t = torch.tensor(tokens)
            qg = q[h * self.G:(h + 1) * self.G]
            w = torch.softmax(qg @ self.K[h, t].T / math.sqrt(q.shape[1]), -1)  # line 25
            out[h * self.G:(h + 1) * self.G] = w @ self.V[h, t]
        if self.left > self.indexed:  # lines 26-36: the page that left goes into the trees now
            self.indexed = self.left
            self._grow(lambda tree, keys: tree.insert(keys))
        return out, reads


def library_tree(forest, h):
    """The library's tree of head h: (levels, parents with the root as ROOT, pages as token sets)."""
    n = forest.n
    parents = [ROOT if p < 0 else p for p in forest.parent[h, :n].tolist()]
    pages = {frozenset(tree_page(forest, h, c)) for c in range(forest.n_pages[h])}
    return forest.level[:n].tolist(), parents, pages


def paper_tree(tree):
    return list(tree.level), list(tree.parent), {frozenset(page) for page in tree.pages}


class Row(NamedTuple):
    layer: int
    got: list  # per KV head, the tokens the library read
    want: list  # and the transcription's
    diff: float  # the largest difference of the attention outputs
    left: bool  # a page left the window on this step
    n_pages: int  # the library's largest tree, in pages, before the step
    scored: tuple  # keys scored by the page queries so far: the library's, the transcription's


def run(spec, T=600, steps=40, r=R, seed=0):
    policy = make(spec).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    paper = [PaperLayer(i, CFG.n_groups, r) for i in range(CFG.n_layers)]
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    trees, rows = [], []
    for i, layer in enumerate(policy.layers):  # each layer its own random q, k, v
        q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
        layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
        paper[i].prefill(k[0], v[0])
        trees.append([(library_tree(layer.forest, h), paper_tree(t)) for h, t in enumerate(paper[i].trees)])
    for _ in range(steps):
        for i, layer in enumerate(policy.layers):
            q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
            left_before, n_pages = paper[i].left, max(layer.forest.n_pages)
            out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
            want, reads = paper[i].decode(q[0, :, 0], k[0, :, 0], v[0, :, 0])
            got = [set(r) - {-1} for r in layer.attended_indices().tolist()]
            scored = layer.forest.scored, sum(tree.scored for tree in paper[i].trees)
            rows.append(Row(i, got, reads, float((out.double() - want).abs().max()), paper[i].left > left_before,
                            n_pages, scored))
        policy.end_step()
    trees += [[(library_tree(layer.forest, h), paper_tree(t)) for h, t in enumerate(paper[i].trees)]
              for i, layer in enumerate(policy.layers)]
    return rows, trees, paper, policy


def check(rows, trees):
    for pairs in trees:
        for (lib_levels, lib_parents, lib_pages), (levels, parents, pages) in pairs:
            assert lib_levels == levels  # Alg. 2 / Alg. 1 lines 29-33: the random promotion
            assert lib_parents == parents  # QUERY(k, T, l + 1, 1)
            assert lib_pages == pages  # the nodes cut into pages
    for row in rows:
        assert row.got == row.want, row.layer  # sink, the union of the group's pages, window
        assert row.diff < 1e-5
        assert row.scored[0] == row.scored[1]  # P-DCI's candidates: as many keys scored


def test_paper_preset_is_algorithms_1_to_4():
    rows, trees, paper, _ = run(SPEC)
    assert sum(row.left for row in rows) >= 8  # pages left the window and were inserted
    for layer in paper:  # the search is not exhaustive: nodes larger than the field of view
        tree = layer.trees[0]
        assert len(tree.pages) > K and max(len(kids) for kids in tree.children.values()) > 40
    check(rows, trees)


def test_paper_preset_with_a_deeper_tree():
    """r = 0.1 (the paper gives no value; `ratio` is free under the preset): three levels and more,
    so the parents' greedy descent passes through a level between the root and the parent."""
    rows, trees, paper, _ = run(SPEC + ",ratio=0.1", T=400, steps=24, r=0.1)
    assert all(layer.trees[0].top >= 3 for layer in paper)
    check(rows, trees)


def test_offload_after_attention_is_not_algorithm_1():
    """The check has teeth: the default order reads the leaving page one step longer."""
    rules = "promotion=random,gqa=union,descent=greedy,simple=4,composite=2,batch=1"
    rows, *_ = run(SPEC.replace("icecache:paper", f"icecache:{rules},window_offload=after"), T=200, steps=12)
    assert any(row.got != row.want for row in rows if row.left)


def test_the_preset_sets_the_papers_rules():
    policy = make("icecache:paper,budget=512")
    assert (policy.window_offload, policy.promotion, policy.gqa, policy.descent) == ("before", "random", "union", "greedy")
    assert (policy.simple, policy.composite, policy.batch, policy.ratio, policy.prop) == (M_SIMPLE, L_COMP, 1, R, PROP)
    with pytest.raises(ValueError, match="preset=paper sets window_offload=before"):
        make("icecache:paper,window_offload=after")
    with pytest.raises(ValueError, match="preset=paper sets gqa=union"):
        make("icecache:paper,gqa=first_k")
    with pytest.raises(ValueError, match="window_offload=before needs window >= 2 \\* page_size"):
        make("icecache:paper,window=16,page_size=16")
