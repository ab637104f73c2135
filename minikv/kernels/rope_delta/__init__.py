"""rope_delta: move RoPE-rotated keys from position p to p + delta (see reference.py)."""
from __future__ import annotations

import torch

from .. import builtin, lookup
from . import reference

builtin("rope_delta", reference.rope_delta)


def rope_delta(x: torch.Tensor, delta, inv_freq: torch.Tensor, *, out: torch.Tensor | None = None,
               backend: str = "eager") -> torch.Tensor:
    """x (B, H, T, D) rotated by delta ((T,) or () int) with inv_freq (R/2,) float32; a new tensor
    like x, or `out` when given (x itself, or memory disjoint from x). Channels >= R are copied
    unchanged."""
    return lookup("rope_delta", backend)(x, delta, inv_freq, out)


def rope_delta_(x: torch.Tensor, delta, inv_freq: torch.Tensor, *, backend: str = "eager") -> torch.Tensor:
    """In place: rotate x (B, H, T, D), e.g. a slice of a preallocated cache, by delta. Returns x."""
    return rope_delta(x, delta, inv_freq, out=x, backend=backend)


__all__ = ["rope_delta", "rope_delta_"]
