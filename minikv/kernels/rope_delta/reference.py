"""Delta rotation, eager reference: move keys cached after RoPE at position p to position p + delta.

Rotations compose, R(p + delta) = R(delta) R(p), so a key already rotated to p is moved by rotating
it again with the angle of `delta` alone (Eq. 4 of the lazy-pruning paper); the pre-RoPE key is
never needed. Same convention as minikv/models/rope.py: rotate-half layout, channel i of the first
half pairs with channel i + R/2, angles delta * inv_freq computed in float32, channels >= R (partial
rotary) pass through.

    x        (B, H, T, D)  any float dtype, any strides (e.g. a slice along T of a preallocated cache)
    delta    (T,) int, one shift per token, or () / python int, one shift for the whole block
    inv_freq (R/2,) float32, R = rotary_dim <= D
    out      like x; may be x itself (in place), but must not partially overlap it (programs of
             the kernel would race): move overlapping blocks through a scratch buffer

Memory traffic: eagerly, each line below is a kernel that reads and writes a float32 tensor the
size of half the rotary block: two upcasts, four products, two sums, two downcasting copies back,
plus a full copy of x when out is new and the cos/sin tables. The kernel reads x once and writes
the result once, with cos/sin in registers: all that a memory-bound rotation can hope for.
"""
from __future__ import annotations

import torch


def rope_delta(x: torch.Tensor, delta, inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    half = inv_freq.numel()  # R/2
    delta = torch.as_tensor(delta, device=x.device)
    angles = delta.float()[..., None] * inv_freq.to(x.device)  # (T, R/2) or (R/2,) float32
    cos, sin = angles.cos(), angles.sin()

    x1 = x[..., :half].float()  # (B, H, T, R/2): pairs with x2 channel by channel
    x2 = x[..., half : 2 * half].float()
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin

    if out is None:
        out = x.clone()  # keeps the pass-through channels >= R
    elif out is not x:
        out[..., 2 * half :] = x[..., 2 * half :]
    out[..., :half] = y1  # x1, x2 are float32 copies, so writing into x itself is safe
    out[..., half : 2 * half] = y2
    return out
