"""Tensor operations, each as an eager PyTorch reference and a Triton kernel.

One folder per operation: `reference.py` (plain PyTorch, the readable one), `fused.py` (the
Triton kernel and a launcher that asserts layout, with the reference's signature) and
`__init__.py` (the public function, which dispatches on `backend`). Policies pick a backend once
and never hold two copies of their logic:

    from minikv.kernels.rope_delta import rope_delta
    k = rope_delta(k, delta, inv_freq, backend="triton")

backend="eager" runs the reference anywhere; so does backend="reference", the policies' choice
of their readable algorithms (at kernel level the readable form is reference.py either way, so
`check_backend` answers "eager" for it). backend="triton" runs the kernel: compiled on CUDA, and in
Triton's *interpreter* when no CUDA device is present (TRITON_INTERPRET=1). The
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
import sys
import warnings
from types import ModuleType

import torch

BACKENDS = ("reference", "eager", "triton")


def check_backend(backend: str) -> str:
    """The kernel backend that runs `backend` here ("eager" for "reference", else `backend`), or
    a ValueError if it names none or cannot run here.

    backend="triton" without CUDA runs in Triton's interpreter: allowed (with a warning, once,
    that it is slow) when the interpreter is in effect; refused at once when triton was imported
    in compiled mode, because it would only fail at the first kernel call, mid-generation."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of: " + ", ".join(map(repr, BACKENDS)))
    if backend == "triton" and not torch.cuda.is_available():
        if not interpreter_in_effect():
            raise ValueError(
                "backend='triton' without a CUDA device needs Triton's interpreter, and triton was imported "
                "before it was selected: set TRITON_INTERPRET=1 in the environment (or import minikv before "
                "triton), or use backend=eager")
        global _warned_slow
        if not _warned_slow:
            _warned_slow = True
            warnings.warn("backend=triton without CUDA runs Triton's interpreter: same results, but seconds "
                          "per token; backend=eager is the fast CPU path", stacklevel=3)
    return "eager" if backend == "reference" else backend


_warned_slow = False


def select_interpreter_without_cuda() -> None:
    """Without CUDA, Triton runs only in its interpreter: select it before anything imports triton.

    Why this runs when minikv is imported: triton.jit picks interpreter or compiler when it
    *decorates* a function, and triton.language's own helpers (tl.max, tl.sum, ...) are decorated
    when triton is first imported, which torch does by itself (building a model on the meta device
    imports torch._dynamo, which imports triton). An explicit TRITON_INTERPRET is left as it is."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreter_in_effect() -> bool:
    """True when Triton kernels decorated from now on, and triton.language's helpers, interpret."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    if "triton" not in sys.modules:
        return True  # triton will read the variable when it is imported
    import triton.language.standard as standard

    return type(standard.max).__name__ == "InterpretedFunction"


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
