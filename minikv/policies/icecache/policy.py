"""icecache (IceCache; paper 001): the policy's parameters, their checks, and the layers it makes.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539.

The decode step is layer.py (read it first); this module builds its parts: per layer a tree
(tree.DCIForest; pdci.PDCIForest with descent=greedy; counts.CountedForest where search.py's loops
count what they score), its semantic pages (layer.SemanticPages) in a paged.PagedKV, and the search
the layer runs, picked by backend: `reference` search.py's loops; `eager` (the CPU default,
faster) pages_fast.py; `triton` scores gathered keys with kernels/dci_scores (search_fast.py);
descent=greedy pdci.py whatever the backend. The tree and the host pages stay on the host
(tiers.backend_on): beside a GPU the search and the gather run eager there, and `triton` runs the
scatter and the paged attention on the device.

The paper's rules: `icecache:paper` (PAPER below: the page leaves before attention, random
promotion, the union over a group, P-DCI over 4 x 2 indices with Algorithm 4 as written, pdci.py).
Decisions (docs/design.md, "icecache" and "The paper as a preset"): budget = sink + window + K
pages of page_size per KV head; defaults from the authors' LongBench scripts (pages of 16, budget
256 = 2 sink + 2 window + 12 retrieved pages, layers 0-1 full). GQA: each query head searches its
KV head's tree; by default the group's lists of K pages are merged round-robin into K pages (the
authors' code), with gqa=union each query head takes K // G pages and the group reads their union
(the paper). IceCache(reuse) (App. C): with reuse_every = r, layers skip_layers, skip_layers + r,
... own a tree; the r - 1 after an anchor keep their own KV in the anchor's pages and read the
pages it selected. By default the oldest window page leaves after attention (window_offload=after):
the window reads at least window - P + 1 tokens, where the paper's order reads window - P on the
step that fills a page. The query is the current step's q (no speculation, the authors' default).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ...kernels import check_backend
from ..contract import LayerKV, Policy, param
from ..full import FullLayer
from ..paged import PagedKV
from ..paged_checks import check_page_geometry
from ..pool import Staging
from ..pool_fast import pool_attention
from ..registry import register
from ..tiers import backend_on
from . import pdci, search
from .counts import CountedForest, report
from .layer import IceCacheLayer, SemanticPages
from .pages_fast import fast_search
from .promotion import FIRST_PROMOTION, promotion_levels, promotion_stream, random_directions
from .search import CLOSEST, field_of_view
from .tree import DCIForest


@register
@dataclass(eq=False, kw_only=True)
class IceCache(Policy):
    """Semantic pages (DCI-tree leaves) on the host, the best few per KV head recalled each step."""

    name = "icecache"
    max_batch = 1
    kernels = ("dci_scores", "paged_attention", "page_gather", "page_layout", "decode_attention")  # skip_layers: full
    # the paper's rules (docs/design.md, "The paper as a preset"): the page leaves before attention
    # (Alg. 1 lines 16-17); random promotion with one fixed r (Alg. 1 lines 29-33, Alg. 2, App. B.1);
    # the union of the group's pages (Sec. 4.2); several P-DCI indices (Sec. 3.3) and Algorithm 4
    # as written, parents by QUERY(k, T, l, 1); P-DCI's stop checked after every point
    PAPER = dict(window_offload="before", promotion="random", gqa="union", descent="greedy", simple=4, composite=2,
                 batch=1)
    # the contract matrix's data (contract.Policy, "What check_policy reads")
    covering_spec = "icecache:page_size=2,budget=160,sink=2,window=4,skip_layers=0"
    small_spec, small_budget = "icecache:page_size=2,budget=16,sink=2,window=4,skip_layers=0", 16
    stats_keys = ("pages_recalled", "pages_recalled_per_step", "keys_scored_fraction", "mean_page_fill")
    offloads = True

    page_size: int = param(16, low=1)
    budget: int = param(256, low=0, multiple_of="page_size")
    sink: int = param(32, low=0, multiple_of="page_size")
    window: int = param(32, low=0, multiple_of="page_size")
    skip_layers: int = param(2, low=0)
    reuse_every: int = param(1, "IceCache(reuse): a layer searches, the next reuse_every - 1 reuse its pages", low=1)
    fov: int | None = param(None, "field of view: nodes kept per level (none: max(30, 0.0015 n); capped by the context)",
                            low=1)
    prop: float = param(0.8, "share of a node's children scored before the search stops", above=0.0, high=1.0)
    batch: int = param(CLOSEST, "projections a node's scan scores per step", low=1)
    seed: int = param(0, "seed of the random projection directions and of the random promotion")
    promotion: str = param("counter", "levels: a deterministic counter in token order, 1 in 100 then 1 in 5 (the "
                                      "authors' code), or random: while Random(0, 1) < ratio (the paper)",
                           choices=("counter", "random"))
    ratio: float = param(0.01, "the promotion ratio r of promotion=random", above=0.0, high=0.9)
    gqa: str = param("first_k", "a GQA group's pages: its query heads' lists round-robin, the first k distinct (the "
                                "authors' code), or union: the union of K // G pages per query head (the paper)",
                     choices=("first_k", "union"))
    descent: str = param("level", "the query: level opens the fov best keys of each level, parents exact (the "
                                  "authors' code); greedy is Algorithm 4 as written (each node's fov best, parents "
                                  "by a k = 1 descent) over simple x composite P-DCI indices",
                         choices=("level", "greedy"))
    simple: int = param(1, "P-DCI simple indices per composite index (m; descent=greedy)", low=1)
    composite: int = param(1, "P-DCI composite indices (L; descent=greedy)", low=1)
    window_offload: str = param("after", "when the oldest window page leaves the device on the step that fills the "
                                         "last page: before attention (the paper's Algorithm 1, lines 16-17) or after "
                                         "it (that step still reads it)", choices=("before", "after"))

    def __post_init__(self):
        super().__post_init__()
        check_page_geometry(self.page_size, self.budget, self.sink, self.window)
        least = self.sink + self.window + self.page_size
        if self.budget < least:
            raise ValueError(f"budget must be >= sink + window + page_size = {least} "
                             f"(at least one retrieved page), got {self.budget}")
        if self.window_offload == "before" and self.window < 2 * self.page_size:
            raise ValueError(f"window_offload=before needs window >= 2 * page_size = {2 * self.page_size} (the "
                             f"page that leaves is not the one the new token fills), got {self.window}")
        if self.descent == "level" and self.simple * self.composite > 1:
            raise ValueError(f"simple * composite P-DCI indices > 1 need descent=greedy (the level descent "
                             f"projects on one direction), got simple={self.simple}, composite={self.composite}")
        if self.descent == "greedy" and self.batch != 1:
            raise ValueError(f"descent=greedy checks P-DCI's stop after every point (batch=1), got batch={self.batch}")
        self.search = self.backend  # "reference": search.py's loops; else the fast forms
        self.host_backend = check_backend(self.backend)  # "reference" runs the eager kernels; see validate

    def validate(self, cfg):
        # never more retrieved pages than a tree over the context has (DCIForest.max_pages: the
        # full pages, plus one open page per parent): a budget past it costs what full KV costs
        parents = self.max_len // FIRST_PROMOTION if self.promotion == "counter" else self.max_len  # at most
        most_pages = self.max_len // self.page_size + parents + 2
        self.n_select = min((self.budget - self.sink - self.window) // self.page_size, most_pages)
        G = cfg.n_heads // cfg.n_kv_heads
        if self.gqa == "union" and self.n_select < G:
            raise ValueError(f"gqa=union gives each of a group's {G} query heads K // G pages: the budget must leave "
                             f"K >= {G} retrieved pages, got K = {self.n_select}")
        if self.skip_layers > cfg.n_layers:
            raise ValueError(f"skip_layers must be <= the model's {cfg.n_layers} layers, got {self.skip_layers}")
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("icecache does not combine with a sliding-window model (Mistral) shorter than max_len")
        # the projection vectors, shared by all layers and heads: one (the default), or the m L of
        # the P-DCI indices (descent=greedy); the first is the same either way
        self.U = random_directions(cfg.head_dim, self.simple * self.composite, self.seed)
        # The tree and its keys live on the host, as in the paper (Sec. 4.3: the DCI query runs on
        # CPU threads, the selected pages are aggregated in a CPU buffer, sent in one PCIe copy and
        # scattered on the GPU): dci_scores and page_gather run where their tensors are, eager
        # beside a GPU, while the scatter (page_layout) and paged_attention run `backend` there.
        self.host_backend = backend_on("host", check_backend(self.backend), self.tiers.device)
        self._anchor_of: dict[int, IceCacheLayer] = {}

    def allocate_shared(self) -> None:
        # one pair of recall staging buffers for all layers (they run in turn)
        self.staging = Staging((self.cfg.n_kv_heads * self.n_select, 2, self.page_size, self.cfg.head_dim),
                               self.dtype, self.tiers)

    def make_layer(self, index: int) -> LayerKV:
        if index < self.skip_layers:
            return FullLayer(self, index)
        first = index - (index - self.skip_layers) % self.reuse_every  # the anchor at or before it
        anchor = None if first == index else self._anchor_of[first]
        forest, searcher, page_lists = self.make_search(index) if anchor is None else (
            anchor.forest, anchor.searcher, anchor.page_lists)
        pages = SemanticPages(forest=forest, owner=anchor is None, page_size=self.page_size, dtype=self.dtype,
                              tiers=self.tiers)
        kv = PagedKV(candidates=pages, n_kv=self.cfg.n_kv_heads, head_dim=self.cfg.head_dim, page_size=self.page_size,
                     max_len=self.max_len, n_sink=self.sink // self.page_size, n_select=self.n_select,
                     n_window=self.window // self.page_size, dtype=self.dtype, tiers=self.tiers, backend=self.backend,
                     staging=self.staging, attention=pool_attention if self.backend == "eager" else None)
        G = self.cfg.n_heads // self.cfg.n_kv_heads
        union = self.gqa == "union"  # a union of G lists of K // G pages fits K slots
        layer = IceCacheLayer(self, index, forest=forest, kv=kv, anchor=anchor, page_lists=page_lists,
                              merge=pdci.merge_union if union else search.merge_group,
                              k=self.n_select // G if union else self.n_select, searcher=searcher)
        if anchor is None:
            self._anchor_of[index] = layer
        return layer

    def make_search(self, index: int):
        """The tree of the layer `index` and the search its layer runs (the dispatch by backend):
        -> (forest, its batched search or None, page_lists(forest, q (Hq, D), k))."""
        shape = dict(n_heads=self.cfg.n_kv_heads, head_dim=self.cfg.head_dim, page_size=self.page_size,
                     capacity=self.max_len)
        if self.promotion == "random":  # the paper's levels, drawn from this layer's stream
            shape["levels"] = promotion_levels(self.max_len, self.ratio, promotion_stream(self.seed, index))
        if self.descent == "greedy":  # the paper's P-DCI indices and Algorithm 4 as written, whatever the backend
            forest = pdci.PDCIForest(U=self.U, simple=self.simple, composite=self.composite, prop=self.prop, **shape)
            return forest, None, partial(pdci.page_lists, fov=self.fov, prop=self.prop)
        if self.search == "reference":  # search.py's loops (Algorithms 3-4), counted by counts.py
            forest = CountedForest(u=self.U[0], **shape)
            return forest, None, partial(search.page_lists, fov=self.fov, prop=self.prop, batch=self.batch)
        forest = DCIForest(u=self.U[0], **shape)
        searcher = fast_search(forest, self.host_backend)  # batched, its state kept beside the tree
        searcher.params = (self.prop, self.fov, self.batch)  # what it prepares once the tree is built

        def batched(f, q, k):  # q (Hq, D) -> per KV head, per query head of its group, its k pages
            fov = field_of_view(f.n) if self.fov is None else self.fov
            return searcher.select_pages(q.view(f.H, -1, q.shape[-1]), None, k, fov, self.prop, self.batch).tolist()
        return forest, searcher, batched

    def aux_bytes(self) -> tuple[int, int]:
        return self.staging.nbytes()

    def stats(self) -> dict:
        return {**super().stats(), **report(self)}
