"""Helpers for testing kernels against their references: tolerances per dtype, an error report in
relative RMS and max-abs (flash-linear-attention style), and NaN poisoning.

Tolerances are for a kernel against its reference when both accumulate in float32 and round once
to the output dtype; they allow a couple of units in the last place of that dtype (under Triton's
interpreter, float32 -> bfloat16 casts truncate instead of rounding to nearest, one more ulp).
"""
from __future__ import annotations

import torch

# dtype -> (atol, rtol); bfloat16 keeps 8 significant bits (ulp 2**-7 relative), float16 11
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def error_report(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double())
    rel_rms = diff.square().mean().sqrt() / expected.double().square().mean().sqrt().clamp_min(1e-30)
    return f"relative RMS error {rel_rms.item():.3g}, max abs error {diff.abs().max().item():.3g}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 atol: float | None = None, rtol: float | None = None, name: str = "output") -> None:
    """torch.testing.assert_close with TOLERANCES[dtype] by default, NaN never equal to NaN, and
    the message led by the relative RMS and max-abs errors."""
    default_atol, default_rtol = TOLERANCES[dtype or expected.dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.cpu(), expected.cpu()
    assert not actual.isnan().any(), f"{name}: {actual.isnan().sum().item()} NaN (unwritten or poisoned elements)"
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol, rtol=rtol,
        msg=lambda m: f"{name}: {error_report(actual, expected)} (atol {atol:g}, rtol {rtol:g})\n{m}",
    )


# Kernel tests run on the GPU when there is one, else on CPU tensors under Triton's interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_tensor(shape, dtype: torch.dtype, seed: int, device=DEVICE) -> torch.Tensor:
    """Standard normal values from their own generator, so hypothesis can shrink a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)
