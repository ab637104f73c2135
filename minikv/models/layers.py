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
from .rope import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


class GatedMLP(nn.Module):
    """Llama/Mistral/Qwen2 MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


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


def attend(q, k, v, positions, rope, layer_kv=None, window=None, decoding=False):
    """RoPE at absolute positions, then attention: by the policy's layer when there is one,
    else plain causal attention over these tokens alone (a forward without a cache).

    q (B, Hq, T, D); k, v (B, Hkv, T, D); positions (B, T); rope = (cos, sin) (B, 1, T, R)
    -> (B, Hq, T, D)
    """
    q = apply_rotary(q, *rope)
    k = apply_rotary(k, *rope)
    if layer_kv is None:
        return dense_attention(q, k, v, window=window)
    if decoding:
        return layer_kv.decode(q, k, v, positions)
    return layer_kv.prefill(q, k, v, positions)
