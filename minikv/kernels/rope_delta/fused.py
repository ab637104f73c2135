"""Delta rotation, Triton kernel: one pass over the block, cos/sin computed in registers.

Program (t-block, b) computes cos/sin of delta * inv_freq for BLOCK_T tokens once and reuses them
for every head of row b, then rotates each head's (BLOCK_T, R/2) pair of halves and, when writing
to a separate output, copies the pass-through channels >= R in the same pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import empty
from .. import launch as configs

# 2*pi split Cody-Waite style: n * TWO_PI_HI is exact in float32 for |n| < 2**16 (HI has 8
# significant bits), so the reduction below loses nothing but LO's own rounding (~1e-10 * n).
TWO_PI_HI = tl.constexpr(6.28125)
TWO_PI_LO = tl.constexpr(0.0019353071795864769)  # 2*pi - 6.28125
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _rope_delta_kernel(
    x_ptr, out_ptr, delta_ptr, inv_freq_ptr,
    H, T, TAIL,  # heads, tokens, pass-through channels D - R
    sxb, sxh, sxt, sxd,  # x strides
    sob, soh, sot, sod,  # out strides
    s_delta,  # 0 when one delta serves the whole block
    HALF: tl.constexpr,  # R/2
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    COPY_TAIL: tl.constexpr,  # out is not x and D > R
):
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 offsets: a cache can exceed 2**31 elements
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    i = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,) pair index
    t_ok = t < T
    mask = t_ok[:, None] & (i < HALF)[None, :]  # (BLOCK_T, BLOCK_HALF)

    delta = tl.load(delta_ptr + t * s_delta, mask=t_ok, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)
    # The float32 product is exactly the reference's angle, rounding included. Reduce it to
    # [-pi, pi] before cos/sin: on GPUs those may lower to fast approximations (cos.approx.f32)
    # that are accurate only near zero, and delta * inv_freq reaches thousands of radians.
    angle = delta[:, None] * inv_freq[None, :]  # (BLOCK_T, BLOCK_HALF)
    n = tl.floor(angle * INV_TWO_PI + 0.5)
    angle = (angle - n * TWO_PI_HI) - n * TWO_PI_LO
    cos, sin = tl.cos(angle), tl.sin(angle)  # (BLOCK_T, BLOCK_HALF) float32

    xh = x_ptr + b * sxb + t[:, None].to(tl.int64) * sxt  # (BLOCK_T, 1) pointers into head 0
    oh = out_ptr + b * sob + t[:, None].to(tl.int64) * sot
    for _ in range(H):
        x1 = tl.load(xh + i[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xh + (i + HALF)[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
        # both halves are in registers before either store, so out may alias x
        tl.store(oh + i[None, :] * sod, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(oh + (i + HALF)[None, :] * sod, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        if COPY_TAIL:
            j = 2 * HALF + tl.arange(0, BLOCK_TAIL)
            tail_mask = t_ok[:, None] & (j < 2 * HALF + TAIL)[None, :]
            tail = tl.load(xh + j[None, :] * sxd, mask=tail_mask)
            tl.store(oh + j[None, :] * sod, tail, mask=tail_mask)
        xh += sxh  # advancing the pointer keeps h * stride out of int32 arithmetic
        oh += soh


def rope_delta(x: torch.Tensor, delta, inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    assert x.dim() == 4, f"x must be (B, H, T, D), got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    target = configs.target(x.device)
    configs.check_device(target, x)
    B, H, T, D = x.shape
    half = inv_freq.numel()
    assert half >= 1 and inv_freq.dim() == 1 and inv_freq.dtype == torch.float32, "inv_freq must be (R/2,) float32"
    assert 2 * half <= D, f"rotary_dim {2 * half} > head_dim {D}"
    inv_freq = inv_freq.to(x.device)  # no-op when the caller keeps it there, as it should
    if torch.is_tensor(delta):
        assert not delta.is_floating_point(), "delta must be an int tensor"
        delta = delta.to(x.device)
    else:
        delta = torch.full((1,), int(delta), dtype=torch.int64, device=x.device)  # a fill, no host copy
    assert delta.numel() == 1 or delta.shape == (T,), f"delta must be () or (T,) = ({T},), got {tuple(delta.shape)}"
    if out is None:
        out = empty(x.shape, x.dtype, x.device)
    assert out.shape == x.shape and out.dtype == x.dtype, "out must match x in shape and dtype"
    if x.numel() == 0:
        return out

    delta = delta.reshape(-1)
    cfg = configs.rope_delta(T, half, D - 2 * half, target.arch)
    grid = (triton.cdiv(T, cfg.blocks["BLOCK_T"]), B)
    _rope_delta_kernel[grid](
        x, out, delta, inv_freq.contiguous(),
        H, T, D - 2 * half,
        *x.stride(), *out.stride(), 0 if delta.numel() == 1 else delta.stride(0),
        HALF=half,
        COPY_TAIL=out.data_ptr() != x.data_ptr() and D > 2 * half,
        **cfg.kwargs(),
    )
    return out
