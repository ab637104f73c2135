"""Rotary position embeddings (RoPE): frequencies, scaling, partial rotary, delta rotation, and
the tables each layer of a model rotates with in one forward (LayerRope).

Convention: the "rotate half" layout of Hugging Face Llama / GPT-NeoX. The first `rotary_dim`
channels of a head are split into two halves (x1, x2); channel i of x1 pairs with channel i of x2
and the pair is rotated by the angle p * inv_freq[i]. Channels past `rotary_dim` (Pythia's partial
rotary) pass through untouched. llama.cpp stores Q/K rows interleaved instead; loading.py undoes
that permutation so that this one convention holds everywhere.

Rotations compose: R(p) R(delta) = R(p + delta). So a key cached after RoPE at position p can be
moved to position p + delta by applying RoPE again with position delta, without knowing the
pre-RoPE key. This is Eq. 4 of the lazy-pruning paper, computed by kernels/rope_delta.
"""
from __future__ import annotations

import math

import torch


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # inv_freq[i] = base^(-2i / rotary_dim), i = 0 .. rotary_dim/2 - 1; float32 as in HF
    # explicit device: models are built under `with torch.device("meta")`, tables must stay real
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    return 1.0 / (base ** (steps / rotary_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are slowed by `factor`, short ones kept,
    and the band between them interpolated smoothly (Meta's reference, HF `rope_type="llama3"`)."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = default_inv_freq(rotary_dim, base)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding:
    """cos/sin tables computed on the fly from integer positions (any shape).

    Not an nn.Module: it holds no weights, only inv_freq, which depends on the config alone.
    """

    def __init__(self, head_dim: int, rotary_dim: int, base: float, scaling: dict | None = None):
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and <= head_dim, got {rotary_dim} / {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.inv_freq = rope_inv_freq(rotary_dim, base, scaling)  # (rotary_dim/2,) float32

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (...) int -> cos, sin (..., rotary_dim) float32
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[..., None] * inv_freq  # (..., rotary_dim/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., rotary_dim), rotate-half layout
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x (B, H, T, D), positions (B, T) -> RoPE(x, positions), same dtype as x
        cos, sin = self.cos_sin(positions)  # (B, T, rotary_dim)
        return apply_rotary(x, cos[:, None], sin[:, None])


class LayerRope:
    """The (cos, sin) tables a model's forward rotates each layer's q and k with (DecoderLM).

    Global layers rotate at the positions the policy chooses (`policy.rope_positions`: streaming
    renumbers to cache positions, so q and k are rotated once, where they will be read); a layer
    whose sliding window the runtime keeps (`policy.keeps_window(i)`, policies/window.py) at the
    tokens' absolute positions, with the local RoPE base where the model has one (Gemma 3's
    local layers, unscaled). Most models need one table for every layer."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.local = (RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_local_theta)
                      if cfg.rope_local_theta is not None else None)

    def tables(self, positions: torch.Tensor, policy=None):
        """positions (B, T) absolute -> one (cos, sin) pair, each (B, 1, T, rotary_dim), when every
        layer rotates alike, else a list of one pair per layer (shared where equal). Padding (-1)
        is never attended: any angle will do."""
        rope_positions = policy.rope_positions(positions) if policy is not None else positions
        tables = {}

        def table(local_base: bool, absolute: bool):
            if (local_base, absolute) not in tables:
                rope = self.local if local_base else self.rope
                cos, sin = rope.cos_sin((positions if absolute else rope_positions).clamp(min=0))  # (B, T, R)
                tables[local_base, absolute] = (cos[:, None], sin[:, None])  # broadcast over heads
            return tables[local_base, absolute]

        per_layer = []
        for i in range(self.cfg.n_layers):
            local = self.cfg.layer_window(i) is not None
            absolute = policy is None or rope_positions is positions or policy.keeps_window(i)
            per_layer.append(table(local and self.local is not None, absolute))
        return per_layer[0] if len(tables) == 1 else per_layer


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (..., D); cos, sin (..., R) with R = rotary_dim <= D, broadcastable against x[..., :R].
    # Computed in float32 and cast back, as HF does for bf16/fp16 activations.
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary (Pythia): the channels past it pass through
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    if x.dtype == torch.float32:  # (no casts to dispatch: a decode step calls this 60 times)
        return x * cos + rotate_half(x) * sin
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
