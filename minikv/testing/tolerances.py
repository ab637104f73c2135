"""Tolerances for a kernel against its reference: per dtype, an error report in relative RMS and
max-abs (flash-linear-attention style), and NaN never equal to NaN (poisoned inputs that leak).

Tolerances are for a kernel against its reference when both accumulate in float32 and round once
to the output dtype; they allow a couple of units in the last place of that dtype (under Triton's
interpreter, float32 -> bfloat16 casts truncate instead of rounding to nearest, one more ulp).

Element-wise tolerances alone are weak in low precision: bfloat16's atol of 2e-2 passes an
attention kernel that drops one of 111 tokens (that token's weight times its value is below it).
So `assert_close` also bounds the relative RMS error over the whole tensor, which rounding keeps
near one ulp (2**-9 for bfloat16) and a missing or duplicated element pushes far above.
"""
from __future__ import annotations

import torch

# dtype -> (atol, rtol); bfloat16 keeps 8 significant bits (ulp 2**-7 relative), float16 11
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


# dtype -> the most relative RMS error rounding explains (a few ulp of the dtype, averaged)
REL_RMS = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    diff = torch.where(a == e, 0.0, a - e)  # equal elements, infinities included, err by nothing
    scale = torch.where(e.isfinite(), e, 0.0)
    return (diff.square().mean().sqrt() / scale.square().mean().sqrt().clamp_min(1e-30)).item()


def error_report(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = torch.where(actual.double() == expected.double(), 0.0, actual.double() - expected.double())
    return f"relative RMS error {relative_rms(actual, expected):.3g}, max abs error {diff.abs().max().item():.3g}"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 atol: float | None = None, rtol: float | None = None, name: str = "output",
                 rel_rms: float | None = None) -> None:
    """torch.testing.assert_close with TOLERANCES[dtype] by default, NaN never equal to NaN, the
    message led by the relative RMS and max-abs errors; and the relative RMS error at most
    REL_RMS[dtype] (or rtol, if a looser one is given; or `rel_rms` where the test derives its
    own bound, as for errors that grow with a position)."""
    default_atol, default_rtol = TOLERANCES[dtype or expected.dtype]
    max_rel_rms = rel_rms if rel_rms is not None else max(REL_RMS[dtype or expected.dtype], rtol or 0.0)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.cpu(), expected.cpu()
    assert not actual.isnan().any(), f"{name}: {actual.isnan().sum().item()} NaN (unwritten or poisoned elements)"
    overflow = actual.isinf() & expected.isfinite()
    assert not overflow.any(), f"{name}: {overflow.sum().item()} infinite where the reference is finite (an overflow)"
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol, rtol=rtol,
        msg=lambda m: f"{name}: {error_report(actual, expected)} (atol {atol:g}, rtol {rtol:g})\n{m}",
    )
    if actual.numel():
        rel = relative_rms(actual, expected)
        assert rel <= max_rel_rms, f"{name}: {error_report(actual, expected)}, above {max_rel_rms:g} relative RMS"


def default_device() -> torch.device:
    """Where kernels are checked: the GPU when there is one, else CPU tensors (Triton's interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_tensor(shape, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    """Standard normal values from their own generator (on CPU, so the same on every device),
    so that hypothesis can shrink a seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)
