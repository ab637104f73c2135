"""Faster one-row products on the CPU: the modules minikv.fast puts in place of the model's
plain nn.Linear and StackedLinear, holding the same parameters.

A decode step multiplies one row by each weight, and on the CPU four things make that faster
than F.linear on the checkpoint's row-major weight (docs/speed.md):
- eager, float32: the weight stored column-major (`column_major`), which MKL reads 1.4x faster;
- eager, several threads: the output rows cut into one block per thread, one batched product
  (MKL runs a one-row SGEMM on one thread whatever torch's thread count);
- eager, bfloat16 on a CPU with AMX: oneDNN's product on a prepacked weight;
- traced into a compiled decode step (compiled.py): `matvec`, a multiply-and-sum that inductor
  turns into one loop over the weight's rows, split over the threads.
Prefill (many rows) takes F.linear (oneDNN's product with AMX), in either layout.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.layers import StackedLinear


def column_major(w: torch.Tensor) -> bool:
    """Whether eager decoding reads this matrix faster stored column-major: float32 on the CPU.

    A decode step is a chain of products x @ W.T. On the CPU, MKL runs them about 1.4x faster
    (the output head 1.7x) when W's storage is W.T contiguous: measured on SmolLM2's shapes, two
    threads, 37 ms a token against 49. bfloat16 runs slower that way (35 against 31 ms), CUDA's
    cuBLAS is tuned for row-major, and the compiled step's loop reads rows: those keep the
    checkpoint's row-major layout."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2


def matvec_layout(w: torch.Tensor) -> torch.Tensor:
    # the same values, column-major where column_major(w) says so
    return w.t().contiguous().t() if column_major(w) else w


class FastLinear(nn.Linear):
    """nn.Linear whose one-row products take the CPU's faster paths (module docstring)."""

    @classmethod
    def holding(cls, linear: nn.Linear) -> "FastLinear":
        """A FastLinear holding `linear`'s parameters (the same Parameter objects: ties stay)."""
        with torch.device("meta"):  # no memory for the weights it is about to drop
            fast = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        fast.weight, fast.bias = linear.weight, linear.bias
        return fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one_row = x.numel() == x.shape[-1]
        if torch.compiler.is_compiling():  # traced into a compiled decode step (compiled.py)
            return matvec(x, self.weight, self.bias) if one_row else F.linear(x, self.weight, self.bias)
        packed = self.amx_packed() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
        if packed is not None:  # bfloat16 on a CPU with AMX: oneDNN on the prepacked weight
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        w, threads = self.weight, torch.get_num_threads()
        if threads == 1 or x.device.type != "cpu" or not one_row or w.shape[0] % threads:
            return F.linear(x, w, self.bias)
        # x (..., in) one row: its leading dims of 1 broadcast against the blocks,
        # (threads, in, out / threads) -> (threads, 1, out / threads), the blocks in output order
        y = torch.matmul(x, self.blocks(threads)).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def blocks(self, threads: int) -> torch.Tensor:
        """The weight as (threads, in, out / threads) blocks of output rows, a view in either
        layout (kept per thread count and storage: a loaded or replaced weight gets new blocks).
        torch.bmm hands each block to its own thread: 1.04-1.32x faster per product at two
        threads on SmolLM2's shapes."""
        w = self.weight
        key = (threads, w.data_ptr(), w.stride())
        if getattr(self, "_blocks_key", None) != key:
            self._blocks = w.detach().view(threads, -1, w.shape[1]).transpose(1, 2)
            self._blocks_key = key
        return self._blocks

    def amx_packed(self) -> torch.Tensor | None:
        """The weight in oneDNN's blocked layout for AMX tiles, or None where that does not apply
        (not bfloat16 on a CPU with AMX). Kept per storage, like blocks(): a replaced weight is
        packed again; the parameter itself stays as loaded (state_dict, the compiled step), so
        a packed model holds its bfloat16 weights twice."""
        w = self.weight
        if not (w.dtype == torch.bfloat16 and w.device.type == "cpu" and amx_bf16()):
            return None
        key = (w.data_ptr(), w.stride())
        if getattr(self, "_packed_key", None) != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            self._packed_key = key
        return self._packed


class FastStackedLinear(FastLinear, StackedLinear):
    """StackedLinear with FastLinear's products. Traced into a compiled decode step, one matvec
    per part over the stacked weight's row blocks (views): inductor's loop reads SmolLM2's gate
    and up as two 1536-row products faster than as one of 3072 rows (1.15x for the MLP at one
    thread, the same at two)."""

    @classmethod
    def holding(cls, linear: StackedLinear) -> "FastStackedLinear":
        with torch.device("meta"):
            fast = cls(linear.in_features, linear.parts, bias=linear.bias is not None)
        fast.weight, fast.bias = linear.weight, linear.bias
        return fast

    def parts_of(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x (..., in) -> one (..., rows of part) tensor per part, in stacking order
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            sizes = list(self.parts.values())
            biases = [None] * len(sizes) if self.bias is None else self.bias.split(sizes)
            return tuple(matvec(x, w, b) for w, b in zip(self.weight.split(sizes), biases))
        return self.split(self(x))


def swap_linears(model: nn.Module) -> None:
    """Every plain nn.Linear and StackedLinear of model replaced, in place, by its fast form
    holding the same parameters (ties kept; state_dict keys and load hooks unchanged)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is StackedLinear:
                setattr(parent, name, FastStackedLinear.holding(child))
            elif type(child) is nn.Linear:
                setattr(parent, name, FastLinear.holding(child))


@functools.cache
def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in AMX tiles and torch's oneDNN can use them.

    There, bfloat16 one-row products on a prepacked weight (FastLinear.amx_packed) read half
    float32's bytes at a speed float32 products do not reach: a decode step's products 25.9 ms
    against 36.4 (float32, column-major) and 37.7 (bfloat16 F.linear), one thread. Without AMX
    (AVX512-BF16 alone, or AVX2) the other paths stay."""
    ops = torch.ops.mkldnn
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # torch >= 2.3
    return (torch.backends.mkldnn.is_available() and amx()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def matvec(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row times a weight, written as multiply-and-sum for a compiled decode step
    (compiled.py): inductor turns it into one loop over w's rows, vectorised and split over the
    CPU threads, with nothing materialised, and it reads the weight faster than MKL's one-row
    SGEMM. Accumulates in float32 whatever the dtype.

    x (..., in) holding one row; w (out, in) row-major -> (..., out)

    The row is made a buffer of its own first (as_strided onto its own layout: inductor
    materialises the input of an as_strided). Otherwise inductor inlines whatever produced it
    (a norm, the MLP's gate) into the loop over w's rows and recomputes it for every row: the
    norm and the product of the output head at one thread took 4.6 ms in bfloat16 that way,
    2.0 ms with the row computed once (float32: 4.1 and 3.8 ms)."""
    xf = x.reshape(1, -1).float()  # (1, in)
    xf = torch.as_strided(xf, xf.shape, xf.stride())
    y = (xf * w.float()).sum(-1).to(x.dtype)  # (out,)
    y = y.view(*x.shape[:-1], -1)
    return y if bias is None else y + bias
