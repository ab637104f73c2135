"""icecache: semantic KV pages, the leaves of a DCI tree per KV head (IceCache; paper 001).

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539.

Pages are clusters of keys that point the same way (the tree's leaves), not runs of consecutive
tokens, so a query's few relevant keys sit in a few pages. One decode step of a layer (Alg. 1):

  line 20       IceCacheLayer.decode: the new token joins the window (PagedKV.append)
  lines 16-17   PagedKV.leave_window: the last page fills up, the oldest window page leaves the
                device (window_offload=before, the paper's order: before attention; the default
                `after` runs it after line 25)
  line 22       IceCacheLayer.select: PAGE-SELECT (Alg. 3-4), search.page_lists (descent=greedy:
                pdci.page_lists), then the GQA merge
  line 23       PagedKV.recall: only the pages not already on the device, bulk-copied (Sec. 4.3)
  line 25       PagedKV.attend: sink, selected pages and window through a page table, partly
                filled pages masked (kernels/paged_attention)
  lines 26-36   PagedKV.store -> SemanticPages.offload: the page that left goes into the tree
                (tree.DCIForest.insert) and, bit for bit, into its tokens' host pages
  prefill (lines 3-12) dense attention; the tokens between sink and window indexed (DCIForest.build)

Backends: `reference` runs search.py's loops; `eager` (the CPU default, faster) runs
pages_fast.py; `triton` scores gathered keys with kernels/dci_scores (search_fast.py). The tree
and the host pages stay on the host (tiers.backend_on): beside a GPU the search and the gather
run eager there, and `triton` runs the scatter and the paged attention on the device.

The paper's rules: `icecache:paper` (PAPER below: the page leaves before attention, random
promotion, the union over a group, P-DCI over 4 x 2 indices with Algorithm 4 as written, pdci.py).
Decisions (docs/design.md, "icecache" and "The paper as a preset"): budget = sink + window + K
pages of page_size per KV head; defaults from the authors' LongBench scripts (pages of 16, budget
256 = 2 sink + 2 window + 12 retrieved pages, layers 0-1 full). GQA: each query head searches its
KV head's tree; by default the group's lists of K pages are merged round-robin into K pages (the
authors' code), with gqa=union each query head takes K // G pages and the group reads their union
(the paper). A tree of at most K pages is read whole. IceCache(reuse) (App. C): with reuse_every =
r, layers skip_layers, skip_layers + r, ... own a tree; the r - 1 after an anchor keep their own KV
in the anchor's pages and read the pages it selected. By default the oldest window page leaves
after attention (window_offload=after): the window reads at least window - P + 1 tokens, where the
paper's order reads window - P on the step that fills a page. The query is the current step's q (no
speculation, the authors' default).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import check_backend
from ..contract import LayerKV, Policy, dense_attention, param
from ..full import FullLayer
from ..paged import PagedKV
from ..paged_checks import check_page_geometry
from ..paged_stats import PagedLayer
from ..pool import Staging
from ..pool_fast import pool_attention
from ..registry import register
from ..tiers import backend_on
from . import pdci
from .pages_fast import fast_search
from .search import CLOSEST, field_of_view, merge_group, merge_union, page_lists
from .tree import FIRST_PROMOTION, DCIForest, promotion_levels, promotion_stream, random_directions


class SemanticPages:
    """icecache's candidate store: the pages are a DCI forest's leaves, not consecutive runs.

    Tokens that leave the window go into the forest's pages: host (max_pages, Hkv, 2, P, D), page c
    of KV head m at host[c, m] (HND, one contiguous block per page and head, as host_pages.HostPages, so
    a recall copies whole blocks). fill (Hkv, max_pages): tokens this layer has written into each
    page; the slots of a selected page read exactly that many (partly filled pages are masked)."""

    def __init__(self, *, forest: DCIForest, owner: bool, page_size: int, dtype: torch.dtype, tiers):
        self.forest, self.owner, self.P, self.tiers = forest, owner, page_size, tiers
        H, P, D = forest.H, page_size, forest.D
        self.host = torch.zeros(forest.max_pages, H, 2, P, D, dtype=dtype, pin_memory=tiers.pin)
        self.fill = torch.zeros(H, forest.max_pages, dtype=torch.int64)

    def offload(self, k: torch.Tensor, v: torch.Tensor, first: int) -> list[set[int]]:
        """k, v (n, P, Hkv, D) NHD pages leaving the window, candidates first.. : into the tree (an
        anchor layer), then each token into its page on the host, bit for bit. -> per KV head,
        the pages that grew (stale wherever they are resident)."""
        n, P, H, D = k.shape
        m, a = n * P, first * P  # tree ids a .. a + m - 1 (token n_sink P + t)
        keys = self.tiers.to_host(k.permute(2, 0, 1, 3).reshape(H, m, D), fresh=True)  # (Hkv, m, D) in token order
        vals = self.tiers.to_host(v.permute(2, 0, 1, 3).reshape(H, m, D), fresh=True)
        if self.owner:
            if self.forest.n != a:
                raise RuntimeError(f"tree holds {self.forest.n} keys, layer offloads from {a}")
            if a == 0:
                self.forest.build(keys)  # Algorithm 2, at prefill
            else:
                self.forest.insert(keys)  # Algorithm 1, lines 26-36
        page = self.forest.page_of[:, a:a + m]  # (Hkv, m)
        slot = self.forest.slot_of[:, a:a + m]
        head = torch.arange(H)[:, None]
        row = ((page * H + head) * 2 * P + slot).reshape(-1)  # key row of host viewed as (-1, D)
        flat = self.host.view(-1, D)
        flat.index_copy_(0, row, keys.reshape(-1, D).to(flat.dtype))
        flat.index_copy_(0, row + P, vals.reshape(-1, D).to(flat.dtype))  # the values follow the keys
        self.fill.view(-1).index_add_(0, (head * self.forest.max_pages + page).reshape(-1),
                                      torch.ones(H * m, dtype=torch.int64))
        return [set(row) for row in page.tolist()]

    def lens(self, held: list[list[int]]) -> list[list[int]]:
        """Valid tokens of each held page (-1: none): its fill."""
        held_t = torch.tensor(held, dtype=torch.int64)
        return torch.where(held_t >= 0, self.fill.gather(1, held_t.clamp_min(0)), 0).tolist()

    def page_tokens(self, h: int, c: int, n: int, first_token: int) -> list[int]:
        """The absolute indices of page c's first n tokens (of KV head h)."""
        return [first_token + t for t in self.forest.page_token[h, c, :n].tolist()]

    def aux_bytes(self) -> tuple[int, int]:
        return 0, self.fill.numel() * self.fill.element_size()


class IceCacheLayer(PagedLayer):
    def __init__(self, policy: "IceCache", index: int, anchor: "IceCacheLayer | None"):
        super().__init__(policy, index)
        cfg, P = policy.cfg, policy.page_size
        self.anchor = anchor  # None: this layer owns its tree
        if anchor is None:
            shape = dict(n_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=P, capacity=policy.max_len)
            if policy.promotion == "random":  # the paper's levels, drawn from this layer's stream
                shape["levels"] = promotion_levels(policy.max_len, policy.ratio, promotion_stream(policy.seed, index))
            if policy.descent == "greedy":  # the paper's P-DCI indices and QUERY (pdci.py)
                self.forest = pdci.PDCIForest(U=policy.U, simple=policy.simple, composite=policy.composite,
                                              prop=policy.prop, **shape)
            else:
                self.forest = DCIForest(u=policy.U[0], **shape)
            # the batched search (backend eager or triton) keeps its state beside the tree; the
            # greedy descent has one form, pdci.py, whatever the backend
            fast = policy.search != "reference" and policy.descent == "level"
            self.searcher = fast_search(self.forest, policy.host_backend) if fast else None
        else:
            self.forest, self.searcher = anchor.forest, anchor.searcher
        self.K = policy.n_select
        pages = SemanticPages(forest=self.forest, owner=anchor is None, page_size=P, dtype=policy.dtype,
                              tiers=policy.tiers)
        self.kv = PagedKV(candidates=pages, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=P,
                          max_len=policy.max_len, n_sink=policy.sink // P, n_select=self.K,
                          n_window=policy.window // P, dtype=policy.dtype, tiers=policy.tiers,
                          backend=policy.backend, staging=policy.staging,
                          attention=pool_attention if policy.backend == "eager" else None)
        self.G = cfg.n_heads // cfg.n_kv_heads
        self.selection = None  # (Hkv, K) page ids read by the last decode step, -1 pads
        self._read = None  # what the last decode step's attention read, for attended_indices

    # -- PAGE-SELECT (Algorithm 3) and the GQA merge ---------------------------------------------
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) -> (Hkv, K) page ids per KV head, -1 pads: each query head's k pages
        (k = K, or K // G for gqa=union), merged per group."""
        f, K, pol = self.forest, self.K, self.policy
        if max(f.n_pages, default=0) <= K:  # every page fits: nothing to choose
            out = torch.full((f.H, K), -1, dtype=torch.int64)
            for h, n in enumerate(f.n_pages):
                out[h, :n] = torch.arange(n)
            return out
        # each query head searches its KV head's tree (on the host, as in the authors' code)
        q = q[0].cpu()  # (Hq, D)
        k = K // self.G if pol.gqa == "union" else K  # a union of G lists of K // G pages fits K slots
        if pol.descent == "greedy":  # pdci.py: the paper's indices and Algorithm 4 as written
            lists = pdci.page_lists(f, q, k, pol.fov, pol.prop)
        elif pol.search == "reference":  # search.py: Algorithms 3-4 as loops over levels and nodes
            lists = page_lists(f, q, k, pol.fov, pol.prop, pol.batch)
        else:
            fov = field_of_view(f.n) if pol.fov is None else pol.fov
            lists = self.searcher.select_pages(q.view(f.H, self.G, -1), None, k, fov, pol.prop, pol.batch).tolist()
        merge = merge_union if pol.gqa == "union" else merge_group  # (G lists of k) -> K pages, -1 pads
        return torch.tensor([merge(group, K) for group in lists], dtype=torch.int64)

    # -- the contract ----------------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D): dense attention over the prompt, then page it
        out = dense_attention(q, k, v)
        self.kv.prefill(k, v)
        f, pol = self.forest, self.policy
        if self.anchor is None and f.n and self.searcher is not None:  # the search's layouts, with the tree
            self.searcher.prepare(pol.prop, field_of_view(f.n) if pol.fov is None else pol.fov, pol.batch)
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D)
        pol, kv = self.policy, self.kv
        q1 = q[:, :, 0]  # (1, Hq, D)
        kv.append(k, v)  # line 20, first: the page that leaves (lines 16-17) is never the new token's
        before = pol.window_offload == "before"
        left = kv.leave_window() if before else None  # lines 16-17 in the paper's order: before attention
        if kv.n_cand:
            self.selection = self.select(q1) if self.anchor is None else self.anchor.selection  # line 22
            pol.pages_recalled += kv.recall(self.selection)  # line 23
        out = kv.attend(q1)[:, :, None]  # line 25: (1, Hq, 1, D)
        self._read = kv.last_read  # attend's record: length, candidates, held pages and their fills
        if before:
            if left is not None:
                kv.store(*left)  # lines 26-36: its tokens into the tree (insert) and the host pages
        else:
            kv.roll()  # lines 16-17 and 26-36 after attention: this step still read the page
        return out

    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64 absolute token indices the last decode step's attention read per KV
        head (sink, selected pages, window), -1 pads; None before any decode step."""
        return None if self._read is None else self.kv.read_indices()  # pages' tokens: SemanticPages.page_tokens

    # -- accounting ------------------------------------------------------------------------------
    def allocated_host_tokens(self) -> int:
        return self.forest.max_pages * self.kv.P  # page slots reserved per KV head

    def aux_bytes(self) -> tuple[int, int]:
        device, host = super().aux_bytes()  # the paged store's; the staging buffers are the policy's
        return device, host + (self.forest.nbytes() if self.anchor is None else 0)


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
        self.reset_counters()

    def reset_counters(self) -> None:
        self.pages_recalled = 0

    def allocate_shared(self) -> None:
        # one pair of recall staging buffers for all layers (they run in turn)
        self.staging = Staging((self.cfg.n_kv_heads * self.n_select, 2, self.page_size, self.cfg.head_dim),
                               self.dtype, self.tiers)

    def make_layer(self, index: int) -> LayerKV:
        if index < self.skip_layers:
            return FullLayer(self, index)
        first = index - (index - self.skip_layers) % self.reuse_every  # the anchor at or before it
        layer = IceCacheLayer(self, index, None if first == index else self._anchor_of[first])
        if first == index:
            self._anchor_of[index] = layer
        return layer

    def aux_bytes(self) -> tuple[int, int]:
        return self.staging.nbytes()

    def stats(self) -> dict:
        s = super().stats()
        ice = [layer for layer in self.layers if isinstance(layer, IceCacheLayer)]
        forests = [layer.forest for layer in ice if layer.anchor is None]
        decode_steps = max(self.steps - 1, 0)
        scored = sum(f.scored for f in forests)
        searched = sum(f.searched for f in forests)
        pages = sum(sum(f.n_pages) for f in forests)
        tokens = sum(f.n * f.H for f in forests)
        s.update({
            "pages_recalled": self.pages_recalled,
            "pages_recalled_per_step": self.pages_recalled / decode_steps if decode_steps else float(self.pages_recalled),
            "keys_scored_fraction": scored / searched if searched else float("nan"),
            "mean_page_fill": tokens / (pages * self.page_size) if pages else float("nan"),
        })
        return s
