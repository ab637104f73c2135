"""dci_scores: exact inner products of queries against gathered DCI candidate keys, with top-k
(see reference.py)."""
from __future__ import annotations

import torch

from .. import check_backend, load_fused
from . import reference


def dci_scores(q: torch.Tensor, keys: torch.Tensor, heads: torch.Tensor, cand: torch.Tensor, k: int, *,
               backend: str = "eager"):
    """q (R, D), keys (H, N, D), heads (R,) int, cand (R, C) int64 key ids (-1 pad), 1 <= k <= C ->
    (scores (R, C) float32, -inf at pads; best (R, k) int64 positions in cand, -1 past the valid)."""
    if not 1 <= k <= cand.shape[1]:
        raise ValueError(f"k must be in [1, C={cand.shape[1]}], got {k}")
    if check_backend(backend) == "eager":
        return reference.dci_scores(q, keys, heads, cand, k)
    return load_fused("dci_scores").dci_scores(q, keys, heads, cand, k)


__all__ = ["dci_scores"]
