"""icecache's decode step (IceCache's Algorithm 1): semantic pages, the leaves of a DCI tree per KV head.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539.

Pages are clusters of keys that point the same way (the tree's leaves), not runs of consecutive
tokens, so a query's few relevant keys sit in a few pages. One decode step of a layer (Alg. 1):

  line 20       IceCacheLayer.decode: the new token joins the window (PagedKV.append)
  lines 16-17   PagedKV.leave_window: the last page filled, the oldest window page leaves the
                device (window_offload=before, the paper's order; by default after line 25)
  line 22       IceCacheLayer.select: PAGE-SELECT (Alg. 3-4) per query head (search.page_lists),
                merged per GQA group (search.merge_group; pdci.merge_union with gqa=union)
  line 23       PagedKV.recall: only the pages not already on the device, in one copy (Sec. 4.3)
  line 25       PagedKV.attend: sink, selected pages and window (kernels/paged_attention)
  lines 26-36   PagedKV.store -> SemanticPages.offload: the page that left, into the tree
                (tree.DCIForest.insert) and, bit for bit, into its tokens' host pages

policy.py makes each layer's parts (its tree, its pages, the search its backend runs). A tree of
at most K pages is read whole. IceCache(reuse) (App. C): a layer with an `anchor` has no tree of
its own; it keeps its KV in the anchor's pages and reads the pages the anchor selected.
"""
from __future__ import annotations

import torch

from ..contract import dense_attention
from .counts import LayerAccounting, PageAccounting


class SemanticPages(PageAccounting):
    """icecache's candidate store: the pages are a DCI forest's leaves, not consecutive runs.

    Tokens that leave the window go into the forest's pages: host (max_pages, Hkv, 2, P, D), page c
    of KV head m at host[c, m] (HND, one contiguous block per page and head, as host_pages.HostPages, so
    a recall copies whole blocks). fill (Hkv, max_pages): tokens this layer has written into each
    page; the slots of a selected page read exactly that many (partly filled pages are masked)."""

    def __init__(self, *, forest, owner: bool, page_size: int, dtype: torch.dtype, tiers):
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
        if self.owner:  # the layer's pages leave in order: the tree holds exactly tree ids 0 .. a - 1
            self.forest.insert(keys)  # Algorithm 1, lines 26-36 (at prefill: Algorithm 2, build.py)
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


class IceCacheLayer(LayerAccounting):
    """One layer: its paged KV (`kv`, paged.PagedKV over SemanticPages), and the tree it searches
    (`forest`: its own, or its anchor's under IceCache(reuse); `searcher`: a batched form's, policy.py)."""

    def __init__(self, policy, index: int, *, forest, kv, anchor: "IceCacheLayer | None", page_lists, merge,
                 k: int, searcher=None):
        super().__init__(policy, index)
        self.forest, self.kv, self.anchor, self.searcher = forest, kv, anchor, searcher
        # page_lists(forest, q (Hq, D), k) -> per KV head, per query head of its group, its k pages
        # (k = K, or K // G for gqa=union); merge(lists, K) -> K pages, -1 pads (policy.py picks both)
        self.page_lists, self.merge, self.k, self.K = page_lists, merge, k, kv.n_select
        self.leave_before = policy.window_offload == "before"  # lines 16-17 before attention (the paper)
        self.selection = None  # (Hkv, K) page ids read by the last decode step, -1 pads

    def select(self, q: torch.Tensor) -> torch.Tensor:
        """PAGE-SELECT (Algorithm 3) per query head, merged per GQA group: q (1, Hq, D) -> (Hkv, K)
        page ids per KV head, -1 pads."""
        f, K = self.forest, self.K
        if max(f.n_pages) <= K:  # every page fits: nothing to choose
            return torch.tensor([list(range(n)) + [-1] * (K - n) for n in f.n_pages], dtype=torch.int64)
        # each query head searches its KV head's tree (on the host, as in the authors' code)
        lists = self.page_lists(f, q[0].cpu(), self.k)  # backend=reference: search.page_lists
        return torch.tensor([self.merge(group, K) for group in lists], dtype=torch.int64)

    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D): the prompt paged, and dense attention over it
        self.kv.prefill(k, v)
        return dense_attention(q, k, v)

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D)
        kv, q1 = self.kv, q[:, :, 0]  # q1 (1, Hq, D)
        kv.append(k, v)  # line 20, first: the page that leaves (lines 16-17) is never the new token's
        left = kv.leave_window() if self.leave_before else None  # lines 16-17 in the paper's order
        if kv.n_cand:
            self.selection = self.select(q1) if self.anchor is None else self.anchor.selection  # line 22
            kv.recall(self.selection)  # line 23
        out = kv.attend(q1)[:, :, None]  # line 25: (1, Hq, 1, D)
        if not self.leave_before:
            kv.roll()  # lines 16-17 and 26-36 after attention: this step still read the page
        elif left is not None:
            kv.store(*left)  # lines 26-36: its tokens into the tree (insert) and the host pages
        return out
