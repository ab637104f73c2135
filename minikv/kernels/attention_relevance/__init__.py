"""attention_relevance: decode attention over the active KV fused with the relevance scores of
Eq. 2 of the soft-freeze paper (see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, load_fused, lookup
from . import reference


def _triton(q, k, v, lengths, scale=None):
    if lengths is None:  # the launcher reads a length per row
        lengths = torch.full((k.shape[0],), k.shape[2], dtype=torch.int64, device=k.device)
    return load_fused("attention_relevance").attention_relevance(q, k, v, lengths, scale)


builtin("attention_relevance", reference.attention_relevance, _triton)


def attention_relevance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None,
                        scale: float | None = None, *, backend: str = "eager"):
    """q (B, Hq, D) over k, v (B, Hkv, L_cap, D) slots [0, lengths[b]) (lengths >= 1; None: every
    slot of every row) -> (out (B, Hq, D) in q's dtype, s (B, L_cap) float32 with s_j = mean_h
    |q_h . k_j|, 0 past the length). scale (softmax only) defaults to 1/sqrt(D). triton wants q,
    k, v of one dtype."""
    return lookup("attention_relevance", backend)(q, k, v, lengths, scale)


__all__ = ["attention_relevance"]
