"""Building blocks shared by the model families: norms, MLPs, and the attention hand-off.

`attend` is the one place where a model gives q, k, v to the KV-cache policy. Everything before
it (projections, RoPE) is the model's; everything after it (what to keep, where, what attention
reads) is the policy's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import dense_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # PyTorch's fused kernel: one op instead of the seven below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # normalise in float32 (bf16 has too few mantissa bits for the mean of squares), as HF does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact erf GELU, HF "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Linear(nn.Linear):
    """nn.Linear whose one-row products use every CPU thread.

    A decode step multiplies one row by each weight. MKL runs a one-row SGEMM on a single thread
    whatever torch's thread count, so on a multi-core CPU the other cores' memory bandwidth went
    unused. Cut the weight's output rows into one block per thread and multiply them as one
    batched product: torch.bmm hands each block to its own thread. Measured on SmolLM2's shapes,
    two threads: 1.04-1.32x faster per product, 1.11x per decode step (README, Speed). The blocks are views,
    in either weight layout; prefill (many rows) and one thread take F.linear. Traced into a
    compiled decode step, a one-row product is `matvec` instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced into a compiled decode step (compiled.py)
            one_row = x.numel() == x.shape[-1]
            return matvec(x, self.weight, self.bias) if one_row else F.linear(x, self.weight, self.bias)
        packed = self.amx_packed() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
        if packed is not None:  # bfloat16 on a CPU with AMX: oneDNN on the prepacked weight
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        w, threads = self.weight, torch.get_num_threads()
        if threads == 1 or x.device.type != "cpu" or x.numel() != x.shape[-1] or w.shape[0] % threads:
            return F.linear(x, w, self.bias)
        # x (..., in) one row: its leading dims of 1 broadcast against the blocks,
        # (threads, in, out / threads) -> (threads, 1, out / threads), the blocks in output order
        y = torch.matmul(x, self.blocks(threads)).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def blocks(self, threads: int) -> torch.Tensor:
        """The weight as (threads, in, out / threads) blocks of output rows, a view (kept per
        thread count and storage: a loaded or replaced weight gets new blocks)."""
        w = self.weight
        key = (threads, w.data_ptr(), w.stride())
        if getattr(self, "_blocks_key", None) != key:
            self._blocks = w.detach().view(threads, -1, w.shape[1]).transpose(1, 2)
            self._blocks_key = key
        return self._blocks

    def amx_packed(self) -> torch.Tensor | None:
        """The weight in oneDNN's blocked layout for AMX tiles, or None where that does not apply
        (not bfloat16 on a CPU with AMX). Kept per storage, like blocks(): a loaded or replaced
        weight is packed again; the parameter itself stays as loaded (state_dict, the compiled
        step), so a packed model holds its bfloat16 weights twice."""
        w = self.weight
        if not (w.dtype == torch.bfloat16 and w.device.type == "cpu" and amx_bf16()):
            return None
        key = (w.data_ptr(), w.stride())
        if getattr(self, "_packed_key", None) != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            self._packed_key = key
        return self._packed


@functools.cache
def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in AMX tiles and torch's oneDNN can use them.

    There, bfloat16 one-row products on a prepacked weight (Linear.amx_packed) read half
    float32's bytes at a speed float32 products do not reach: a decode step's products 25.9 ms
    against 36.4 (float32, column-major) and 37.7 (bfloat16 F.linear), one thread (README,
    Speed). Without AMX (AVX512-BF16 alone, or AVX2) the plain paths stay."""
    ops = torch.ops.mkldnn
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # torch >= 2.3
    return (torch.backends.mkldnn.is_available() and amx()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def matvec(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row times a weight, written as multiply-and-sum for a compiled decode step
    (compiled.py): inductor turns it into one loop over w's rows, vectorised and split over the
    CPU threads, with nothing materialised, and it reads the weight faster than MKL's one-row
    SGEMM (README, Speed). Accumulates in float32 whatever the dtype.

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


class StackedLinear(Linear):
    """Several linear maps of the same input, stacked along the output dim so that one matmul
    computes them all (q, k, v; gate, up). A decode step is a chain of matrix-vector products
    bound by reading the weights: one larger product instead of three small ones reads the same
    bytes in one longer stream, with a third of the calls.

    Checkpoints keep the parts under their own names (`q_proj.weight`, ...), and so does the
    parent's state_dict(): `stacked_in(parent, name)` splits the parts out on the way out and
    stacks them on the way in (hooks on the parent, which sees its children's keys)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)  # the checkpoint's name of each part -> its rows, in stacking order

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # y (..., sum of parts) -> one (..., rows of part) view per part, in stacking order
        return y.split(list(self.parts.values()), dim=-1)

    def parts_of(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (..., in) -> one (..., rows of part) tensor per part, in stacking order: eager, one
        matmul and views of its output. Traced into a compiled decode step, one matvec per part
        over the stacked weight's row blocks (views): inductor's loop reads SmolLM2's gate and up
        as two 1536-row products faster than as one of 3072 rows (1.15x for the MLP at one
        thread, the same at two; README, Speed)."""
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            sizes = list(self.parts.values())
            biases = [None] * len(sizes) if self.bias is None else self.bias.split(sizes)
            return tuple(matvec(x, w, b) for w, b in zip(self.weight.split(sizes), biases))
        return self.split(self(x))


def stacked_in(parent: nn.Module, name: str) -> None:
    """parent.<name> is a StackedLinear: let the parent's state_dict() and load_state_dict()
    speak the checkpoint's names of its parts (parent.q_proj.weight, not parent.qkv_proj.weight)."""
    stacked = getattr(parent, name)
    sizes = list(stacked.parts.values())

    def keys(prefix: str, kind: str) -> tuple[str, list[str]]:
        return f"{prefix}{name}.{kind}", [f"{prefix}{part}.{kind}" for part in stacked.parts]

    def split_parts(module, state_dict, prefix, local_metadata) -> None:
        for kind in ("weight", "bias"):
            whole, parts = keys(prefix, kind)
            if whole in state_dict:
                state_dict.update(zip(parts, state_dict.pop(whole).split(sizes, dim=0)))

    def stack_parts(module, state_dict, prefix, *args) -> None:
        for kind in ("weight", "bias"):
            whole, parts = keys(prefix, kind)
            if all(p in state_dict for p in parts):  # else load_state_dict reports what is missing
                ws = [state_dict.pop(p) for p in parts]
                if ws[0].dim() == 2 and not ws[0].is_contiguous():
                    # column-major parts (loading.matvec_layout): stack the columns of W.T, so
                    # that the stacked W is column-major too
                    state_dict[whole] = torch.cat([w.t() for w in ws], dim=1).t()
                else:
                    state_dict[whole] = torch.cat(ws, dim=0)

    parent.register_state_dict_post_hook(split_parts)
    parent.register_load_state_dict_pre_hook(stack_parts)


class GatedMLP(nn.Module):
    """Llama/Mistral/Qwen2 MLP: down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.gate_up_proj = StackedLinear(dim, {"gate_proj": hidden, "up_proj": hidden}, bias=bias)
        stacked_in(self, "gate_up_proj")
        self.down_proj = Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        gate, up = self.gate_up_proj.parts_of(x)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """GPT-NeoX MLP: dense_4h_to_h(act(dense_h_to_4h(x)))."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.dense_h_to_4h = Linear(dim, hidden)
        self.dense_4h_to_h = Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    # (B, T, n_heads * D) -> (B, n_heads, T, D)
    B, T, _ = x.shape
    return x.view(B, T, n_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    # (B, H, T, D) -> (B, T, H * D)
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def attend(q, k, v, positions, layer_kv=None, window=None, decoding=False):
    """Attention over q, k, v after RoPE: by the policy's layer when there is one, else plain
    causal attention over these tokens alone (a forward without a cache).

    q (B, Hq, T, D); k, v (B, Hkv, T, D); positions (B, T) -> (B, Hq, T, D)
    """
    if layer_kv is None:
        return dense_attention(q, k, v, window=window)
    if decoding:
        return layer_kv.decode(q, k, v, positions)
    return layer_kv.prefill(q, k, v, positions)
