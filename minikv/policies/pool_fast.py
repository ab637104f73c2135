"""The fast CPU form of the pool's attention (pool.py), which the page-based policies pass for
backend=eager: kernels/paged_attention's arithmetic over the pool in place, no gather (tested
against the reference in tests/policies/test_paged.py)."""
from __future__ import annotations

import math

import torch

from ..models.attention import one_query_attention


def pool_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                   page_lens: torch.Tensor) -> torch.Tensor:
    """paged_attention through the pool's page table, the identity (entry j is slot j: it is not
    read), reading the pool in place: q (1, Hq, D), k_pages, v_pages (S, P, Hkv, D), page_lens
    (1, Hkv, S) -> (1, Hq, D). Slot s of KV head m shows its first page_lens[0, m, s] tokens; the
    rest get weight exactly 0. Unlike the reference it does not zero the hidden values: the pool
    only ever holds KV written by the model, finite, and 0 times a finite value is 0."""
    S, P, Hkv, D = k_pages.shape
    hidden = (torch.arange(P, device=q.device) >= page_lens[0, :, :, None]).view(Hkv, 1, S * P)
    k = k_pages.view(S * P, Hkv, D).transpose(0, 1)[None].float()  # (1, Hkv, S P, D): a view (a float32 copy in half precision)
    v = v_pages.view(S * P, Hkv, D).transpose(0, 1)[None].float()
    return one_query_attention(q.float()[:, :, None], k, v, 1.0 / math.sqrt(D), hidden)[:, :, 0].to(q.dtype)
