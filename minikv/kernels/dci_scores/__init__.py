"""dci_scores: exact inner products of groups of queries against their shared DCI candidate keys,
with top-k per query (see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("dci_scores", reference.dci_scores)


def dci_scores(q: torch.Tensor, keys: torch.Tensor, heads: torch.Tensor, cand: torch.Tensor, mask: torch.Tensor,
               k: int, *, backend: str = "eager"):
    """q (B, G, D), keys (H, N, D), heads (B,) int, cand (B, C) int64 key ids (-1 pad), mask
    (B, G, C) bool, 0 <= k <= C (0: scores only) -> (scores (B, G, C) float32, -inf where not scored; best (B, G, k)
    int64 positions in cand, -1 past the scored)."""
    if not 0 <= k <= cand.shape[1]:
        raise ValueError(f"k must be in [0, C={cand.shape[1]}], got {k}")
    return lookup("dci_scores", backend)(q, keys, heads, cand, mask, k)


__all__ = ["dci_scores"]
