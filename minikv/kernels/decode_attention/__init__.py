"""decode_attention: one query step over a contiguous, preallocated KV cache (see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("decode_attention", reference.decode_attention)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float | None = None, *, window: int | None = None, return_lse: bool = False,
                     backend: str = "eager"):
    """q (B, Hq, D) over k, v (B, Hkv, L_cap, D) slots [0, lengths[b]) (the last `window` of them
    if given; lengths >= 1) -> out (B, Hq, D) in q's dtype, plus lse (B, Hq) float32 if asked.
    scale defaults to 1/sqrt(D). The triton backend wants q, k, v of one dtype."""
    return lookup("decode_attention", backend)(q, k, v, lengths, scale, window, return_lse)


__all__ = ["decode_attention"]
