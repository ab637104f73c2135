"""gathered_attention: decode attention where each KV head reads its own list of slots (see
reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("gathered_attention", reference.gathered_attention)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                       scale: float | None = None, *, return_lse: bool = False, backend: str = "eager"):
    """q (B, Hq, D) over k, v (B, Hkv, L_cap, D) at the slots index (B, Hkv, N) lists per KV head
    (-1 = none, >= 1 slot per row and head) -> out (B, Hq, D) in q's dtype, plus lse (B, Hq)
    float32 if asked. scale defaults to 1/sqrt(D). triton wants q, k, v of one dtype."""
    return lookup("gathered_attention", backend)(q, k, v, index, scale, return_lse)


__all__ = ["gathered_attention"]
