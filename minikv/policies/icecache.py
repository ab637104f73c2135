"""icecache: semantic KV pages, the leaves of a DCI tree per KV head (IceCache; paper 001).

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
arXiv:2604.10539 (2026), an ICLR 2026 submission, https://arxiv.org/abs/2604.10539.

Pages are not runs of consecutive tokens but clusters of keys that point the same way: the
leaves of a DCI tree (dci.py). A query then finds its few relevant keys concentrated in a few
pages, so a small budget reads what matters. Per layer (Algorithm 1):

  prefill   dense attention over the prompt; the tokens between the sink and the window go to the
            host tier, indexed into a DCI tree per KV head (Algorithm 2, Eqs. 2-3) whose leaves
            are their pages: each token is written into exactly one page, bit for bit.
  decode    the new token joins the window; each query head searches its KV head's tree for the
            pages of its best keys (Algorithms 3-4); the group's page lists are merged
            round-robin into at most k pages per KV head; only the pages not already on the
            device are recalled, gathered into one contiguous buffer, copied once and scattered
            into their slots (Sec. 4.3, bulk loading; kernels/page_gather, page_layout);
            attention reads the sink, the selected pages and the window through a page table,
            partly filled pages masked by their valid counts (kernels/paged_attention).
  after     when the window's last page is full, its oldest page leaves the window and its tokens
            are inserted into the tree (Algorithm 1 lines 26-36).

Budget (DESIGN.md): the most tokens per KV head per layer that attention reads on the device:
sink + window + k pages of page_size. Defaults are the authors' code (LongBench scripts): pages
of 16, budget 256 = 2 sink pages + 2 window pages + 12 retrieved pages, layers 0-1 full.

Decisions where the paper is silent (the authors' code where it speaks, DESIGN.md "icecache"):
  * GQA (Sec. 4.2 says "union"): each query head searches its KV head's tree and gets k pages;
    the lists of a group are interleaved round-robin and the first k distinct pages kept, so a KV
    head reads k pages, not G k (the authors' `first_k_unique`).
  * When a head's tree has at most k pages, all are read without a search: nothing to choose.
  * IceCache(reuse) (Appendix C): with reuse_every = r, layers skip_layers, skip_layers + r, ...
    are anchors: they own a tree and search it; the r - 1 layers after an anchor hold their own
    KV in pages of the anchor's tree (the same tokens grouped the same way) and read the pages
    the anchor selected in the same step.
  * The query is the current step's q: no speculation (the authors' default, n_prefetch = 0).
  * The tree search scans a node's children as the authors' M-DCI does (dci.py: batches of 128
    projections, a node the field of view covers scored whole; `batch`). Scoring only the
    closest 80% of every node (batch = 1) drops a fifth of each upper level's subtrees: it
    missed the passkey's page at 4,000 tokens where the authors' scan finds it.
"""
from __future__ import annotations

import time

import torch

from .base import LayerKV, Policy, dense_attention, register
from .dci import CLOSEST, DCIForest, field_of_view, first_k_distinct, random_direction
from .full import FullLayer
from .paged import PagedKV, PagedLayer, check_page_geometry
from .pool import Staging


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
                                    capacity=policy.max_len, u=policy.u, backend=policy.host_backend)
        else:
            self.forest = anchor.forest
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

    # -- page selection (Algorithms 3-4, GQA merge) ---------------------------------------------
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) -> (Hkv, K) page ids per KV head, -1 pads."""
        f, K, pol = self.forest, self.K, self.policy
        if max(f.n_pages, default=0) <= K:  # every page fits: nothing to choose
            out = torch.full((f.H, K), -1, dtype=torch.int64)
            for h, n in enumerate(f.n_pages):
                out[h, :n] = torch.arange(n)
            return out
        # each query head searches its KV head's tree: blocks of the G query heads of a group
        # (the tree lives on the host: the query goes there, as in the authors' code)
        pages = f.select_pages(q[0].view(f.H, self.G, -1).cpu(), None, K, pol.fov, pol.prop,
                               pol.batch)  # (Hkv, G, K)
        # GQA: the group's lists interleaved round-robin, the first K distinct kept
        rounds = pages.transpose(1, 2).reshape(f.H, K * self.G)
        return first_k_distinct(rounds, K, f.max_pages)

    # -- the contract ----------------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D): dense attention over the prompt, then page it
        out = dense_attention(q, k, v)
        t0 = time.perf_counter()
        self.kv.prefill(k, v)
        f, pol = self.forest, self.policy
        if self.anchor is None and f.n and f.backend == "eager":  # the search's layouts, with the tree
            f.search_layouts(pol.prop, field_of_view(f.n) if pol.fov is None else pol.fov, pol.batch)
        pol.t_index += time.perf_counter() - t0
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D)
        pol, kv = self.policy, self.kv
        q1 = q[:, :, 0]  # (1, Hq, D)
        kv.append(k, v)
        if kv.n_cand:
            t0 = time.perf_counter()
            self.selection = self.select(q1) if self.anchor is None else self.anchor.selection
            t1 = time.perf_counter()
            pol.pages_recalled += kv.recall(self.selection)
            t2 = time.perf_counter()
            pol.t_select += t1 - t0
            pol.t_recall += t2 - t1
        out = kv.attend(q1)[:, :, None]  # (1, Hq, 1, D)
        self._read = kv.last_read  # attend's record: length, candidates, held pages and their fills
        t0 = time.perf_counter()
        kv.roll()  # a full window page leaves: its tokens into the tree and the host pages
        pol.t_index += time.perf_counter() - t0
        return out

    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64 absolute token indices the last decode step's attention read per KV
        head (sink, selected pages, window), -1 pads; None before any decode step."""
        return None if self._read is None else self.kv.read_indices()  # pages' tokens: SemanticPages.page_tokens

    # -- accounting ------------------------------------------------------------------------------
    def allocated_host_tokens(self) -> int:
        return self.forest.max_pages * self.kv.P  # page slots reserved per KV head

    def aux_bytes(self) -> tuple[int, int]:
        device, host = self.kv.aux_bytes()  # (the staging buffers are the policy's)
        return device, host + (self.forest.nbytes() if self.anchor is None else 0)


@register
class IceCache(Policy):
    """Semantic pages (DCI-tree leaves) on the host, the best few per KV head recalled each step."""

    name = "icecache"
    max_batch = 1

    def __init__(self, *, page_size: int = 16, budget: int = 256, sink: int = 32, window: int = 32,
                 skip_layers: int = 2, reuse_every: int = 1, fov: int | None = None, prop: float = 0.8,
                 batch: int = CLOSEST, seed: int = 0, backend: str = "eager"):
        super().__init__(backend=backend)
        check_page_geometry(page_size, budget, sink, window)
        if budget < sink + window + page_size:
            raise ValueError(f"budget must be >= sink + window + page_size = {sink + window + page_size} "
                             f"(at least one retrieved page), got {budget}")
        if not isinstance(skip_layers, int) or skip_layers < 0:
            raise ValueError(f"skip_layers must be an int >= 0 (the first layers keep full KV), got {skip_layers!r}")
        if not isinstance(reuse_every, int) or reuse_every < 1:
            raise ValueError(f"reuse_every must be an int >= 1 (1: every layer searches), got {reuse_every!r}")
        if fov is not None and (not isinstance(fov, int) or fov < 1):
            raise ValueError(f"fov must be a positive int, or none for max(30, 0.0015 n), got {fov!r}")
        if not isinstance(prop, (int, float)) or not 0 < prop <= 1:
            raise ValueError(f"prop (share of a node's children scored) must be in (0, 1], got {prop!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch (projections a node's scan scores per step) must be an int >= 1, got {batch!r}")
        self.page_size, self.budget, self.sink, self.window = page_size, budget, sink, window
        self.n_select = (budget - sink - window) // page_size
        self.skip_layers, self.reuse_every, self.fov, self.prop = skip_layers, reuse_every, fov, float(prop)
        self.batch = batch
        self.seed = seed
        # the tree and its keys live on the host tier; Triton reaches host memory only when there
        # is no GPU (interpreter), so with CUDA the host-side operations run eager
        self.host_backend = backend

    def validate(self, cfg):
        if self.skip_layers > cfg.n_layers:
            raise ValueError(f"skip_layers must be <= the model's {cfg.n_layers} layers, got {self.skip_layers}")
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("icecache does not combine with a sliding-window model (Mistral) shorter than max_len")
        self.u = random_direction(cfg.head_dim, self.seed)  # one projection vector for all layers and heads
        self.host_backend = "eager" if self.tiers.device.type == "cuda" else self.backend
        self._anchor_of: dict[int, IceCacheLayer] = {}
        self.reset_counters()

    def reset_counters(self) -> None:
        self.pages_recalled = 0
        self.t_select = self.t_recall = self.t_index = 0.0
        self.t_decode = 0.0
        self._t_step = None

    def is_anchor(self, index: int) -> bool:
        return index >= self.skip_layers and (index - self.skip_layers) % self.reuse_every == 0

    def make_layer(self, index: int) -> LayerKV:
        if index == 0:  # one pair of recall staging buffers for all layers (they run in turn)
            self.staging = Staging((self.cfg.n_kv_heads * self.n_select, 2, self.page_size, self.cfg.head_dim),
                                   self.dtype, self.tiers)
        if index < self.skip_layers:
            return FullLayer(self, index)
        first = index - (index - self.skip_layers) % self.reuse_every  # the anchor at or before it
        layer = IceCacheLayer(self, index, None if first == index else self._anchor_of[first])
        if first == index:
            self._anchor_of[index] = layer
        return layer

    def aux_bytes(self) -> tuple[int, int]:
        return self.staging.nbytes()

    def end_step(self, logits=None):
        now = time.perf_counter()
        if self._t_step is not None:
            self.t_decode += now - self._t_step  # the decode step just ended (prefill excluded)
        self._t_step = now
        return super().end_step(logits)

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
            "select_s": self.t_select,
            "recall_s": self.t_recall,
            "index_s": self.t_index,
            "search_share": self.t_select / self.t_decode if self.t_decode else float("nan"),
            "recall_share": self.t_recall / self.t_decode if self.t_decode else float("nan"),
        })
        return s
