"""Building blocks shared by the model families: norms, MLPs, and the attention hand-off.

`attend` is the one place where a model gives q, k, v to the KV-cache policy. Everything before
it (projections, RoPE) is the model's; everything after it (what to keep, where, what attention
reads) is the policy's.
"""
from __future__ import annotations

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


class StackedLinear(nn.Linear):
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
        # x (..., in) -> one (..., rows of part) tensor per part: one matmul, views of its output
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
                state_dict[whole] = torch.cat([state_dict.pop(p) for p in parts], dim=0)

    parent.register_state_dict_post_hook(split_parts)
    parent.register_load_state_dict_pre_hook(stack_parts)


class GatedMLP(nn.Module):
    """Llama/Mistral/Qwen2 MLP: down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.gate_up_proj = StackedLinear(dim, {"gate_proj": hidden, "up_proj": hidden}, bias=bias)
        stacked_in(self, "gate_up_proj")
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        gate, up = self.gate_up_proj.parts_of(x)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """GPT-NeoX MLP: dense_4h_to_h(act(dense_h_to_4h(x)))."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(dim, hidden)
        self.dense_4h_to_h = nn.Linear(hidden, dim)
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
