"""page_layout: HND host blocks -> NHD device pool (see reference.py). `nhd_to_hnd`, the
offload direction, runs once per page and stays eager."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference
from .reference import nhd_to_hnd

builtin("page_layout", reference.hnd_to_nhd)


def hnd_to_nhd(blocks: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor,
               heads: torch.Tensor, *, backend: str = "eager") -> None:
    """Write blocks (n, 2, P, D) into k_pages[slots[i], :, heads[i]] and v_pages likewise, in place."""
    return lookup("page_layout", backend)(blocks, k_pages, v_pages, slots, heads)


page_layout = hnd_to_nhd  # the op's folder name

__all__ = ["hnd_to_nhd", "nhd_to_hnd", "page_layout"]
