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

Backends by name: each operation's dispatch looks its backend up at call time in one registry,
in which reference, eager and triton are the built-in entries. `register_backend(op, name, fn)`
adds another, `fn` taking the reference's arguments, so that a policy spec `streaming:backend=NAME`
runs the whole policy on a user's kernel without editing minikv. A registered backend need not
cover every operation: the operations it leaves out run eager (register the triton launcher under
its name, `lookup(op, "triton")`, to keep it there). minikv.testing.check_kernel checks one.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import ModuleType
from typing import Callable

import torch

BACKENDS = ("reference", "eager", "triton")  # the built-in ones
OPS = ("attention_relevance", "attention_topk", "dci_scores", "decode_attention", "gathered_attention",
       "page_gather", "page_layout", "page_scores", "paged_attention", "rope_delta")

# op -> backend name -> function with the reference's signature. Each op's __init__ enters its
# built-in three (`builtin`); register_backend adds the others.
_REGISTRY: dict[str, dict[str, Callable]] = {op: {} for op in OPS}


def register_backend(op: str, name: str, fn: Callable) -> None:
    """Run operation `op` with `fn` wherever backend=`name` is asked for: `fn` takes the
    arguments of minikv/kernels/<op>/reference.py's function, in its order, and returns what it
    returns. Registering a name again replaces its function; the built-in names are refused."""
    if op not in OPS:
        raise ValueError(f"unknown kernel operation {op!r}; expected one of: " + ", ".join(OPS))
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a backend name must be an identifier (it goes into policy specs), got {name!r}")
    if name in BACKENDS:
        raise ValueError(f"backend {name!r} is built in; register yours under another name")
    if not callable(fn):
        raise TypeError(f"register_backend({op!r}, {name!r}, fn): fn must be callable, got {type(fn).__name__}")
    _REGISTRY[op][name] = fn


def builtin(op: str, reference_fn: Callable, triton_fn: Callable | None = None) -> None:
    """The built-in entries of op: its reference (as reference and as eager) and its Triton
    launcher (default: fused.py's function of the reference's name, imported at its first call)."""
    if triton_fn is None:
        def triton_fn(*args, entry=reference_fn.__name__):
            return getattr(load_fused(op), entry)(*args)
    _REGISTRY[op].update(reference=reference_fn, eager=reference_fn, triton=triton_fn)


def registered(op: str | None = None) -> tuple[str, ...]:
    """The backends that implement op (None: every backend name known), built-in ones first."""
    if op is not None:
        _load(op)
        return BACKENDS + tuple(n for n in _REGISTRY[op] if n not in BACKENDS)
    return BACKENDS + tuple(dict.fromkeys(n for table in _REGISTRY.values() for n in table if n not in BACKENDS))


def lookup(op: str, backend: str) -> Callable:
    """The function that runs op under `backend` here, with the reference's signature: the
    registered one, or the eager reference where a registered backend leaves op out."""
    name = check_backend(backend)
    _load(op)
    return _REGISTRY[op].get(name, _REGISTRY[op]["eager"])


def _load(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown kernel operation {op!r}; expected one of: " + ", ".join(OPS))
    if "eager" not in _REGISTRY[op]:
        importlib.import_module(f"{__name__}.{op}")  # enters its built-in backends


def policy_backends(ops: tuple[str, ...]) -> tuple[str, ...]:
    """The backends of a policy that runs the operations `ops` with its backend: reference and
    eager anywhere; triton when it runs a kernel at all; a registered backend when it implements
    at least one of them (the others run eager)."""
    user = (n for n in registered() if n not in BACKENDS and any(n in _REGISTRY[op] for op in ops))
    return ("reference", "eager") + (("triton",) if ops else ()) + tuple(user)


def check_backend(backend: str, ops: tuple[str, ...] | None = None, owner: str | None = None) -> str:
    """The kernel backend that runs `backend` here ("eager" for "reference", else `backend`), or
    a ValueError if it names none or cannot run here; with `ops`, the operations policy `owner`
    runs, also one that the policy does not implement (`policy_backends`).

    backend="triton" without CUDA runs in Triton's interpreter: allowed (with a warning, once,
    that it is slow) when the interpreter is in effect; refused at once when triton was imported
    in compiled mode, because it would only fail at the first kernel call, mid-generation."""
    if backend not in BACKENDS and not any(backend in table for table in _REGISTRY.values()):
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of: " + ", ".join(map(repr, registered())))
    if ops is not None and backend not in policy_backends(ops):
        calls = f"its kernels: {', '.join(ops)}" if ops else "it runs no kernel"
        raise ValueError(f"policy {owner!r} does not implement backend {backend!r} ({calls}); expected one of: "
                         + ", ".join(map(repr, policy_backends(ops))))
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
