"""icecache: semantic KV pages, the leaves of a DCI tree per KV head (IceCache; paper 001).

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539.

Pages are clusters of keys that point the same way (the tree's leaves), not runs of consecutive
tokens, so a query's few relevant keys sit in a few pages. One decode step of a layer (Alg. 1):

  line 20       IceCacheLayer.decode: the new token joins the window (PagedKV.append)
  lines 16-17   PagedKV.leave_window: the last page fills up, the oldest window page leaves the
                device (window_offload=before, the paper's order: before attention; the default
                `after` runs it after line 25)
  line 22       IceCacheLayer.select: PAGE-SELECT (Alg. 3-4), search.page_select, then the GQA merge
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

The paper's rules: `icecache:paper` (preset=paper: window_offload=before). Decisions
(docs/design.md, "icecache" and "The paper as a preset"): budget = sink + window + k pages of
page_size per KV head; defaults from the authors' LongBench scripts (pages of 16, budget 256 = 2
sink + 2 window + 12 retrieved pages, layers 0-1 full). GQA: each query head searches its KV
head's tree, the group's lists are merged round-robin into k pages. A tree of at most k pages is
read whole. IceCache(reuse) (App. C): with reuse_every = r, layers skip_layers, skip_layers + r,
... own a tree; the r - 1 after an anchor keep their own KV in the anchor's pages and read the
pages it selected. By default the oldest window page leaves after attention (window_offload=after):
the window reads at least window - P + 1 tokens, where the paper's order reads window - P on the
step that fills a page. The query is the current step's q (no speculation, the authors' default).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import check_backend
from ..contract import LayerKV, Policy, dense_attention, param
from ..full import FullLayer
from ..paged import PagedKV, PagedLayer, check_page_geometry
from ..pool import Staging
from ..registry import register
from ..tiers import backend_on
from .pages_fast import fast_search
from .search import CLOSEST, field_of_view, merge_group, page_select
from .tree import FIRST_PROMOTION, DCIForest, random_direction


class SemanticPages:
    """icecache's candidate store: the pages are a DCI forest's leaves, not consecutive runs.

    Tokens that leave the window go into the forest's pages: host (max_pages, Hkv, 2, P, D), page c
    of KV head m at host[c, m] (HND, one contiguous block per page and head, as paged.HostPages, so
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
            self.forest = DCIForest(n_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=P,
                                    capacity=policy.max_len, u=policy.u)
            # the batched search (backend eager or triton) keeps its state beside the tree
            self.searcher = None if policy.search == "reference" else fast_search(self.forest, policy.host_backend)
        else:
            self.forest, self.searcher = anchor.forest, anchor.searcher
        self.K = policy.n_select
        pages = SemanticPages(forest=self.forest, owner=anchor is None, page_size=P, dtype=policy.dtype,
                              tiers=policy.tiers)
        self.kv = PagedKV(candidates=pages, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=P,
                          max_len=policy.max_len, n_sink=policy.sink // P, n_select=self.K,
                          n_window=policy.window // P, dtype=policy.dtype, tiers=policy.tiers,
                          backend=policy.backend, staging=policy.staging)
        self.G = cfg.n_heads // cfg.n_kv_heads
        self.selection = None  # (Hkv, K) page ids read by the last decode step, -1 pads
        self._read = None  # what the last decode step's attention read, for attended_indices

    # -- PAGE-SELECT (Algorithm 3) and the GQA merge ---------------------------------------------
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) -> (Hkv, K) page ids per KV head, -1 pads."""
        f, K, pol = self.forest, self.K, self.policy
        if max(f.n_pages, default=0) <= K:  # every page fits: nothing to choose
            out = torch.full((f.H, K), -1, dtype=torch.int64)
            for h, n in enumerate(f.n_pages):
                out[h, :n] = torch.arange(n)
            return out
        # each query head searches its KV head's tree (on the host, as in the authors' code)
        q = q[0].cpu()  # (Hq, D)
        if pol.search == "reference":  # search.py: Algorithms 3-4 as loops over levels and nodes
            return page_select(f, q, K, pol.fov, pol.prop, pol.batch)
        fov = field_of_view(f.n) if pol.fov is None else pol.fov
        pages = self.searcher.select_pages(q.view(f.H, self.G, -1), None, K, fov, pol.prop, pol.batch)  # (Hkv, G, K)
        return torch.tensor([merge_group(group, K) for group in pages.tolist()], dtype=torch.int64)

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
    PAPER = dict(window_offload="before")  # Algorithm 1 lines 16-17: the page leaves before attention
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
    seed: int = param(0, "seed of the random projection direction")
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
        self.search = self.backend  # "reference": search.py's loops; else the fast forms
        self.host_backend = check_backend(self.backend)  # "reference" runs the eager kernels; see validate

    def validate(self, cfg):
        # never more retrieved pages than a tree over the context has (DCIForest.max_pages: the
        # full pages, plus one open page per parent): a budget past it costs what full KV costs
        most_pages = self.max_len // self.page_size + self.max_len // FIRST_PROMOTION + 2
        self.n_select = min((self.budget - self.sink - self.window) // self.page_size, most_pages)
        if self.skip_layers > cfg.n_layers:
            raise ValueError(f"skip_layers must be <= the model's {cfg.n_layers} layers, got {self.skip_layers}")
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("icecache does not combine with a sliding-window model (Mistral) shorter than max_len")
        self.u = random_direction(cfg.head_dim, self.seed)  # one projection vector for all layers and heads
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
