"""check_kernel: an implementation of a kernel operation against minikv's reference, on inputs
hypothesis draws, with the operation's tolerance.

    from minikv.testing import check_kernel
    check_kernel("decode_attention", my_decode_attention)   # passes, or AssertionError naming the input

For each operation (minikv/kernels/<op>), attention.py, selection.py and layout.py say what is
drawn (shapes, ragged lengths, GQA groups, odd head dims, strided views, dtypes, the scalar
arguments), how the inputs are built from it (NaN in every slot a correct kernel must not read)
and how a result is compared (relative RMS and element-wise tolerances per dtype, tolerances.py;
selections in the reference's order, ties included). `strategies(op)` hands out the same cases
for tests of one's own; `check(case, fn)` is one comparison.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..kernels import OPS, lookup, registered
from . import attention, layout, selection
from .tolerances import default_device


class Operation(NamedTuple):
    draw: Callable  # hypothesis composite: dtypes -> params
    build: Callable  # (params, device) -> the reference's positional arguments
    compare: Callable  # (got, want, params, got_args, want_args) -> None, or AssertionError
    dtypes: tuple  # the dtypes drawn by default


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _operation(module, op: str, dtypes: tuple) -> Operation:
    return Operation(*(getattr(module, f"{part}_{op}") for part in ("draw", "build", "compare")), dtypes)


OPERATIONS = {
    "decode_attention": _operation(attention, "decode_attention", FLOATS),
    "gathered_attention": _operation(attention, "gathered_attention", FLOATS),
    "paged_attention": _operation(attention, "paged_attention", FLOATS),
    "attention_relevance": _operation(attention, "attention_relevance", FLOATS),
    "attention_topk": _operation(selection, "attention_topk", (torch.float32, torch.bfloat16)),
    "page_scores": _operation(selection, "page_scores", (torch.float32,)),  # the query; boxes are float32
    "dci_scores": _operation(selection, "dci_scores", FLOATS),
    "page_gather": _operation(layout, "page_gather", FLOATS),
    "page_layout": _operation(layout, "page_layout", FLOATS),
    "rope_delta": _operation(layout, "rope_delta", FLOATS),
}
assert set(OPERATIONS) == set(OPS), "every kernel operation has its inputs and comparison here"


@dataclass(frozen=True)
class Case:
    """One drawn input of an operation: `params` (what was drawn), built on `device` by
    `inputs()`, afresh at every call (a kernel may write into its arguments)."""

    op: str
    params: dict
    device: torch.device = field(default_factory=default_device)

    def inputs(self) -> tuple:
        return OPERATIONS[self.op].build(self.params, self.device)

    def replace(self, **params) -> "Case":
        return Case(self.op, {**self.params, **params}, self.device)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in self.params.items())
        return f"{self.op}({shown})"


def operation(op: str) -> Operation:
    if op not in OPERATIONS:
        raise ValueError(f"unknown kernel operation {op!r}; expected one of: " + ", ".join(OPERATIONS))
    return OPERATIONS[op]


def strategies(op: str, *, dtypes=None, device=None) -> st.SearchStrategy[Case]:
    """The cases check_kernel draws for `op`, as a hypothesis strategy of Case: in a test,
    `@given(case=strategies("decode_attention"))`, then `case.inputs()` (the reference's
    positional arguments) and `check(case, fn)`. dtypes: a subset of the operation's own."""
    ops = operation(op)
    dtypes = tuple(dtypes) if dtypes is not None else ops.dtypes
    if not dtypes or any(d not in ops.dtypes for d in dtypes):
        raise ValueError(f"{op} is checked in {', '.join(str(d) for d in ops.dtypes)}; got dtypes {dtypes}")
    device = torch.device(device) if device is not None else default_device()
    return ops.draw(dtypes).map(lambda params: Case(op, params, device))


def check(case: Case, fn: Callable, reference: Callable | None = None) -> None:
    """fn(*case.inputs()) against the reference's result on the same inputs, with the operation's
    tolerance; an AssertionError naming the case (its shapes and parameters) and the error."""
    reference = reference or lookup(case.op, "reference")
    want_args = case.inputs()
    want = reference(*want_args)
    got_args = case.inputs()
    try:
        got = fn(*got_args)
    except Exception as e:  # a crash is a failure on this input too: say which
        raise AssertionError(f"{case}: raised {type(e).__name__}: {e}") from e
    try:
        OPERATIONS[case.op].compare(got, want, case.params, got_args, want_args)
    except AssertionError as e:
        raise AssertionError(f"{case}: {e}") from None


def check_kernel(op: str, fn: Callable | str, *, dtypes=None, examples: int | None = None, device=None) -> None:
    """Check `fn`, a function with the signature of minikv/kernels/<op>/reference.py's (or the
    name of a registered backend: minikv.kernels.register_backend), against the reference on the
    inputs hypothesis draws (`strategies`): `examples` of them (default: the loaded profile's,
    minikv.testing.load_profile), on `device` (default: CUDA if present, else CPU). Returns
    None when every one agrees; raises an AssertionError naming the first (shrunk) input that
    does not, and its error."""
    if isinstance(fn, str):
        if fn not in registered(op):
            raise ValueError(f"no backend {fn!r} is registered for {op}; registered: {', '.join(registered(op))}")
        fn = lookup(op, fn)
    cases = strategies(op, dtypes=dtypes, device=device)
    limits = settings(max_examples=examples or settings.default.max_examples, deadline=None, database=None,
                      report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])

    @limits
    @given(case=cases)
    def agrees(case):
        check(case, fn)

    agrees()
