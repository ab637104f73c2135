"""page_scores: Quest page scores, GQA group reduction and top-k per KV head (see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference
from .reference import GROUP_REDUCES, pack_codes

builtin("page_scores", reference.page_scores)


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_valid: torch.Tensor, k: int,
                scale: float = 1.0, group_reduce: str = "softmax_mean", codes: torch.Tensor | None = None, *,
                backend: str = "eager"):
    """q (B, Hq, D), page boxes lo, hi (B, Hkv, N, D), n_valid (B,) int, k <= N, optional 2-bit key
    codes (B, Hkv, N, P, ceil(D / 4)) uint8 -> (scores (B, Hkv, N) float32, index (B, Hkv, k)
    int64 with -1 past the candidates)."""
    if group_reduce not in GROUP_REDUCES:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCES}, got {group_reduce!r}")
    if not 1 <= k <= lo.shape[2]:
        raise ValueError(f"k must be in [1, N={lo.shape[2]}], got {k}")
    return lookup("page_scores", backend)(q, lo, hi, n_valid, k, scale, group_reduce, codes)


__all__ = ["page_scores", "pack_codes", "GROUP_REDUCES"]
