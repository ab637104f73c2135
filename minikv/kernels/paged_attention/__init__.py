"""paged_attention: one decode query over a paged NHD cache via a per-KV-head page table
(see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("paged_attention", reference.paged_attention)


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    page_lens: torch.Tensor, scale: float | None = None, *, return_lse: bool = False,
                    backend: str = "eager"):
    """q (B, Hq, D) over pool k_pages, v_pages (S, P, Hkv, D) through page_table, page_lens
    (B, Hkv, N) int -> out (B, Hq, D), plus lse (B, Hq) float32 if asked. scale: 1/sqrt(D)."""
    return lookup("paged_attention", backend)(q, k_pages, v_pages, page_table, page_lens, scale, return_lse)


__all__ = ["paged_attention"]
