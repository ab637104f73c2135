"""CPU speed for a loaded model, applied from outside: the model in minikv/models stays plain
(checkpoint-layout weights, nn.Linear, F.linear), as gpt-fast's does, and this package makes it
decode faster without changing what it computes beyond float rounding.

`apply(model, compile=...)` does, on a model whose weights are on the CPU:
1. linear.py: each nn.Linear / StackedLinear becomes a FastLinear / FastStackedLinear holding
   the same parameters: one-row products split over the threads, oneDNN on AMX, `matvec` when
   traced into a compiled step;
2. hugepages.py: every parameter moves into one mapping of transparent huge pages, float32
   matrices column-major for eager products (linear.column_major), row-major for compiled ones;
3. compiled.py, with compile=True: the blocks' work around the policy compiled by inductor,
   installed over the model's `run_blocks` and `head`.
On CUDA, FastLinear's eager products are F.linear's and the weights stay where they are.

`minikv.load` applies it by default; `load(..., fast=False)` or the CLI's `--plain` gives the
plain model, which is what the parity tests pin (tests/models/test_logits.py);
tests/models/test_fast.py holds the fast model to the plain one.
"""
from __future__ import annotations

import torch.nn as nn

from .hugepages import move_parameters
from .linear import FastLinear, column_major, swap_linears


def apply(model: nn.Module, compile: bool = False) -> nn.Module:
    """Make `model` (a DecoderLM) decode faster, in place; returns it. compile=True also compiles
    the decode step (compiled.py); where that cannot run, a line on stderr says so and decoding
    stays eager."""
    swap_linears(model)
    # eager float32 products read column-major weights faster; compiled loops read rows
    move_parameters(model, column_major=(lambda p: False) if compile else column_major)  # CPU ones
    for m in model.modules():  # bfloat16 with AMX: pack now, not inside the first forward
        if isinstance(m, FastLinear):
            m.amx_packed()
    model.compiled = None  # a fast/compiled.CompiledModel once compiled
    if compile:
        from .compiled import compile_decode  # imports inductor: only when asked

        compile_decode(model)
    return model


__all__ = ["apply"]
