"""Tensor operations, each as an eager PyTorch reference and a Triton kernel.

One folder per operation: `reference.py` (plain PyTorch, the readable one), `fused.py` (the
Triton kernel and a launcher that asserts layout, with the reference's signature) and
`__init__.py` (the public function, which dispatches on `backend`). Policies pick a backend once
and never hold two copies of their logic:

    from minikv.kernels.rope_delta import rope_delta
    k = rope_delta(k, delta, inv_freq, backend="triton")

backend="eager" runs the reference anywhere. backend="triton" runs the kernel: compiled on CUDA,
and in Triton's *interpreter* when no CUDA device is present (TRITON_INTERPRET=1). The
interpreter executes each program instance with numpy on CPU tensors; it exists so that the
kernels can be tested on any machine, and it is slow (seconds per call at test sizes), so the
CPU path for real work is "eager".

Why fused modules are imported lazily: `triton.jit` picks the interpreter or the compiler when it
*decorates* a kernel, by reading TRITON_INTERPRET at that moment. So the variable has to be in
os.environ before any fused.py is imported; `load_fused` sets it and only then imports.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("eager", "triton")


def check_backend(backend: str) -> str:
    """Return `backend` if it names a backend, else raise a ValueError that lists them."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of: " + ", ".join(map(repr, BACKENDS)))
    return backend


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter (no CUDA, or TRITON_INTERPRET=1 set)."""
    return not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty for kernel outputs; filled with NaN under the interpreter (tests, where speed
    does not matter), so that an element a kernel forgot to write fails loudly."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if triton_interpreted() else out


def load_fused(op: str) -> ModuleType:
    """Import minikv.kernels.<op>.fused, first selecting the interpreter when there is no CUDA."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit decorations
    return importlib.import_module(f"{__name__}.{op}.fused")
