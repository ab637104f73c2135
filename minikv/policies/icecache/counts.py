"""icecache's statistics and accounting, beside its rule (layer.py, tree.py, search.py), which
never calls them: the keys the reference search scored, counted where it reads them
(CountedForest); the bytes of a tree; what a layer holds and read; stats()' figures (`report`).

    CountedForest      search.query reads each key it scores once, through head_keys, and
                       projects each query once (query_projection): the counts of the reference
                       search (the batched forms and pdci.py count their own)
    forest_bytes       every tensor a tree holds, and what its batched search keeps beside it
    tree_page          the tree ids a page of a tree holds
    PageAccounting     SemanticPages' tokens of a page (attention recall) and its bytes
    LayerAccounting    IceCacheLayer's host slots, aux bytes and the tokens its step read
    report             pages recalled (per decode step), keys scored per key searched, mean fill
"""
from __future__ import annotations

import torch

from ..paged_stats import PagedLayer
from .tree import DCIForest


class CountedForest(DCIForest):
    """A DCIForest that counts what the reference search reads (see the module docstring)."""

    def query_projection(self, q: torch.Tensor) -> torch.Tensor:
        self.searched += self.n * q.shape[0]  # each query searches every key indexed
        return super().query_projection(q)

    def head_keys(self, h: int, ids: torch.Tensor) -> torch.Tensor:
        self.scored += ids.numel()  # keys scored exactly (q.k)
        return super().head_keys(h, ids)


def forest_bytes(forest) -> int:
    """Every tensor the tree holds (its directions aside: shared by all layers), P-DCI's
    projections included (pdci.py), and what its batched searches keep beside it."""
    tensors = [t for name, t in vars(forest).items() if isinstance(t, torch.Tensor) and name not in ("u", "U")]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(w.nbytes() for w in forest.watchers)


def tree_page(forest, h: int, page: int) -> list[int]:
    """Tree ids in page `page` of head h's tree, in slot order."""
    return forest.page_token[h, page, :int(forest.fill[h, page])].tolist()


class PageAccounting:
    """Base of SemanticPages: the tokens of a page, its bytes beside the K/V pages."""

    def page_tokens(self, h: int, c: int, n: int, first_token: int) -> list[int]:
        """The absolute indices of page c's first n tokens (of KV head h)."""
        return [first_token + t for t in self.forest.page_token[h, c, :n].tolist()]

    def aux_bytes(self) -> tuple[int, int]:
        return 0, self.fill.numel() * self.fill.element_size()


class LayerAccounting(PagedLayer):
    """Base of IceCacheLayer: what it reserves on the host, its aux bytes, what its step read."""

    def allocated_host_tokens(self) -> int:
        return self.forest.max_pages * self.kv.P  # page slots reserved per KV head

    def aux_bytes(self) -> tuple[int, int]:
        device, host = super().aux_bytes()  # the paged store's; the staging buffers are the policy's
        return device, host + (forest_bytes(self.forest) if self.anchor is None else 0)

    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64 absolute token indices the last decode step's attention read per KV
        head (sink, selected pages, window), -1 pads; None before any decode step."""
        return self.kv.read_indices() if self.kv.last_read[0] else None  # attend's record, none at prefill


def report(policy) -> dict:
    """The figures IceCache.stats() adds to the tiers'."""
    ice = [layer for layer in policy.layers if isinstance(layer, LayerAccounting)]
    forests = [layer.forest for layer in ice if layer.anchor is None]
    recalled = sum(layer.kv.pages_recalled for layer in ice)
    decode_steps = max(policy.steps - 1, 0)
    scored, searched = sum(f.scored for f in forests), sum(f.searched for f in forests)
    pages, tokens = sum(sum(f.n_pages) for f in forests), sum(f.n * f.H for f in forests)
    return {
        "pages_recalled": recalled,
        "pages_recalled_per_step": recalled / decode_steps if decode_steps else float(recalled),
        "keys_scored_fraction": scored / searched if searched else float("nan"),
        "mean_page_fill": tokens / (pages * policy.page_size) if pages else float("nan"),
    }
