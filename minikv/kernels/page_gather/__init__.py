"""page_gather: gather selected pages into one contiguous buffer, the first step of a bulk
recall (see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("page_gather", reference.page_gather)


def page_gather(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, *, backend: str = "eager") -> torch.Tensor:
    """Copy src[rows[i]] (one page block each) into out[i], i < n: src (M, *block), rows (n,) int,
    out (>= n, *block) -> out[:n]."""
    return lookup("page_gather", backend)(src, rows, out)


__all__ = ["page_gather"]
