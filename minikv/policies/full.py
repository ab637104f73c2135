"""full: the baseline. Every token's K and V stay on the device tier in one preallocated,
contiguous buffer per layer, and attention reads all of them.

It is the only policy that takes a batch of prompts of different lengths: prompts are padded on
the right, padding carries position -1, and each row keeps its own length, so a row's new token
is written right after its last real token and the pad slots are overwritten before they could
ever be read.
"""
from __future__ import annotations

import torch

from ..kernels.decode_attention import decode_attention
from .base import LayerKV, Policy, dense_attention, register


class FullLayer(LayerKV):
    def __init__(self, policy: "Full", index: int):
        super().__init__(policy, index)
        B, cfg = policy.batch_size, policy.cfg
        shape = (B, cfg.n_kv_heads, policy.max_len, cfg.head_dim)
        device = policy.tiers.device
        self.k = torch.empty(shape, dtype=policy.dtype, device=device)
        self.v = torch.empty(shape, dtype=policy.dtype, device=device)
        self.lengths = torch.zeros(B, dtype=torch.int64, device=device)  # valid tokens per row

    def prefill(self, q, k, v, positions):
        # q (B, Hq, T, D); k, v (B, Hkv, T, D); positions (B, T), -1 marks right padding
        T = k.shape[2]
        self.k[:, :, :T] = k
        self.v[:, :, :T] = v
        self.lengths = (positions >= 0).sum(dim=1)
        self.longest = T  # a Python int, so slicing the cache never waits on the device
        # right padding sits after every real token, so plain causal attention is exact for them
        return dense_attention(q, k, v, window=self.cfg.sliding_window)

    def decode(self, q, k, v, positions):
        # q (B, Hq, 1, D); k, v (B, Hkv, 1, D); positions (B, 1)
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, self.lengths] = k[:, :, 0]
        self.v[rows, :, self.lengths] = v[:, :, 0]
        self.lengths = self.lengths + 1
        # Mistral's sliding window: the kernel reads only the last `window` slots of each row
        self.longest += 1
        # read only up to the longest row: the slots past it hold nothing yet
        k_valid, v_valid = self.k[:, :, : self.longest], self.v[:, :, : self.longest]
        out = decode_attention(q[:, :, 0], k_valid, v_valid, self.lengths, window=self.cfg.sliding_window,
                               backend=self.policy.backend)
        return out[:, :, None]

    def device_tokens(self) -> int:
        return float(self.lengths.float().mean()) if len(self.lengths) else 0

    def allocated_device_tokens(self) -> int:
        return self.policy.max_len


@register
class Full(Policy):
    """Keep everything: the reference every other policy is measured against."""

    name = "full"
    max_batch = None

    def __init__(self, *, backend: str = "eager"):
        super().__init__(backend=backend)

    def make_layer(self, index: int) -> FullLayer:
        return FullLayer(self, index)
