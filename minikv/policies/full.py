"""full: the baseline. Every token's K and V stay on the device tier in one preallocated,
contiguous buffer per layer, and attention reads all of them.

It is the only policy that takes a batch of prompts of different lengths: prompts are padded on
the right, padding carries position -1, and each row keeps its own length, so a row's new token
is written right after its last real token and the pad slots are overwritten before they could
ever be read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.decode_attention import decode_attention
from .contract import LayerKV, Policy, dense_attention
from .registry import register


class FullLayer(LayerKV):
    def __init__(self, policy: "Full", index: int):
        super().__init__(policy, index)
        B, cfg = policy.batch_size, policy.cfg
        shape = (B, cfg.n_kv_heads, policy.max_len, cfg.head_dim)
        device = policy.tiers.device
        self.k = torch.zeros(shape, dtype=policy.dtype, device=device)  # read whole every step
        self.v = torch.zeros(shape, dtype=policy.dtype, device=device)
        self.lengths = torch.zeros(B, dtype=torch.int64, device=device)  # valid tokens per row
        self.longest, self.ragged = 0, False  # empty until the prefill

    def prefill(self, q, k, v, positions):
        # q (B, Hq, T, D); k, v (B, Hkv, T, D); positions (B, T), -1 marks right padding
        T = k.shape[2]
        self.k[:, :, :T] = k
        self.v[:, :, :T] = v
        self.lengths = (positions >= 0).sum(dim=1)
        self.longest = T  # a Python int, so slicing the cache never waits on the device
        # rows of different lengths (padding) write and read per row; otherwise every row writes
        # the new token to slot `longest` and reads all slots before it, which plain slicing and
        # PyTorch's fused attention do with a few ops per layer
        self.ragged = bool((self.lengths != T).any())
        # right padding sits after every real token, so plain causal attention is exact for them
        return dense_attention(q, k, v, window=self.cfg.sliding_window)

    def decode(self, q, k, v, positions):
        # q (B, Hq, 1, D); k, v (B, Hkv, 1, D); positions (B, 1)
        if self.ragged:
            rows = torch.arange(k.shape[0], device=k.device)
            self.k[rows, :, self.lengths] = k[:, :, 0]
            self.v[rows, :, self.lengths] = v[:, :, 0]
            self.lengths = self.lengths + 1
        else:
            self.k[:, :, self.longest : self.longest + 1] = k
            self.v[:, :, self.longest : self.longest + 1] = v
        self.longest += 1
        # read only up to the longest row: the slots past it hold nothing yet
        k_valid, v_valid = self.k[:, :, : self.longest], self.v[:, :, : self.longest]
        window = self.cfg.sliding_window
        if not self.ragged and window is None and self.policy.backend == "eager":
            # every row reads all of k_valid: SDPA's fused kernel (the decode_attention reference
            # computes the same over ragged rows and windows, readably but with ~15 ops)
            return dense_attention(q, k_valid, v_valid)
        if not self.ragged:
            self.lengths.fill_(self.longest)
        # Mistral's sliding window: the kernel reads only the last `window` slots of each row
        out = decode_attention(q[:, :, 0], k_valid, v_valid, self.lengths, window=window, backend=self.policy.backend)
        return out[:, :, None]

    def device_tokens(self) -> int:
        if not self.ragged:
            return self.longest
        return float(self.lengths.float().mean()) if len(self.lengths) else 0

    def allocated_device_tokens(self) -> int:
        return self.policy.max_len


@register
@dataclass(eq=False, kw_only=True)
class Full(Policy):
    """Keep everything: the reference every other policy is measured against."""

    name = "full"
    has_paper = False  # the baseline: full:paper is full
    max_batch = None
    kernels = ("decode_attention",)
    # the contract matrix's data (checks.PolicyChecks, "What check_policy reads")
    covering_spec = "full"
    prefill_equals_decoding = True

    def make_layer(self, index: int) -> FullLayer:
        return FullLayer(self, index)
