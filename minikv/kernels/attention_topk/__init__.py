"""attention_topk: a KV head's attention max-pooled over its GQA group, and its top-k tokens
(SyncKV's selection, see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("attention_topk", reference.attention_topk)


def attention_topk(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, n_valid: torch.Tensor,
                   keep: torch.Tensor | None, k_top: int, scale: float | None = None, *, backend: str = "eager"):
    """q (B, Hq, D), k (B, Hkv, L_cap, D), lse (B, Hq) float32, n_valid (B,) int, keep (B, Hkv,
    L_cap) bool or None, k_top >= 1 -> (scores (B, Hkv, L_cap) float32, index (B, Hkv, k_top)
    int64, -1 padded). scale defaults to 1/sqrt(D)."""
    if not isinstance(k_top, int) or k_top < 1:
        raise ValueError(f"k_top must be an int >= 1, got {k_top!r}")
    return lookup("attention_topk", backend)(q, k, lse, n_valid, keep, k_top, scale)


__all__ = ["attention_topk"]
