"""The local layers of a model with sliding windows (Gemma 3's sliding_attention layers, every
layer of a Mistral): the runtime keeps each one's window itself, whatever the policy.

A local layer's query sees its own key and the window - 1 before it, so the KV it will ever read
again is the last `window` tokens: a ring of window slots, token p written to slot p mod window,
bounded whatever the context. No policy has anything to decide there, so `Policy.bind`
(base.py) gives these layers a WindowLayer each and binds the policy to the global layers alone
(`global_view`): a policy's own code never sees a local layer, its `budget`, `skip_layers` and
statistics speak of the global layers. `Policy.stats` counts both kinds: the rings' tokens are
device tokens (they are read every step), and `window_tokens` / `window_bytes` say how many.

A policy that rewinds (softfreeze's rewalk drops up to `max_rewind()` tokens and feeds them again)
gets that many slots more: a token fed again overwrites its old slot, and the tokens before it
that the window needs are still there. Each slot remembers its token's position, and attention
masks by position (query p sees keys p - window < j <= p), so the extra slots never leak.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..models.attention import dense_attention
from .contract import LayerKV

EMPTY = torch.iinfo(torch.int64).max  # the position of an empty slot: after every query, never seen


class WindowLayer(LayerKV):
    def __init__(self, policy, index: int, window: int, slots: int):
        super().__init__(policy, index)
        cfg, B, device = policy.model_cfg, policy.batch_size, policy.tiers.device
        self.cfg, self.window, self.slots = cfg, window, slots
        shape = (B, cfg.n_kv_heads, slots, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=policy.dtype, device=device)
        self.v = torch.zeros(shape, dtype=policy.dtype, device=device)
        self.pos = torch.full((B, slots), EMPTY, dtype=torch.int64, device=device)  # each slot's token
        self.held = 0  # filled slots (row 0; rows of a ragged batch may hold fewer)

    def _write(self, k, v, positions):
        # k, v (B, Hkv, T, D), positions (B, T) absolute, -1 for padding: each real token to its slot;
        # of the tokens that share a slot, the latest (written last) stays
        for b in range(k.shape[0]):
            real = (positions[b] >= 0).nonzero().flatten()[-self.slots:]  # (n,) the last `slots` real tokens
            slot = positions[b, real] % self.slots
            self.k[b, :, slot] = k[b, :, real]
            self.v[b, :, slot] = v[b, :, real]
            self.pos[b, slot] = positions[b, real]
        self.held = int((self.pos[0] != EMPTY).sum())

    def prefill(self, q, k, v, positions):
        # q (B, Hq, T, D); k, v (B, Hkv, T, D): the prompt attends causally within the window, by
        # index (padding is on the right: no real query sees it), in blocks of `window` queries
        # (models/attention.py windowed_attention): O(T x window) time and memory, not T^2
        self._write(k, v, positions)
        return dense_attention(q, k, v, window=self.window)

    def decode(self, q, k, v, positions):
        # q (B, Hq, 1, D); k, v (B, Hkv, 1, D); positions (B, 1)
        self._write(k, v, positions)
        # keys of the window: position in (p - window, p]; an empty slot's EMPTY is after p
        return dense_attention(q, self.k, self.v, q_pos=positions, k_pos=self.pos, window=self.window)

    def device_tokens(self) -> int:
        return min(self.held, self.window)  # what attention reads (the extra slots are masked)

    def allocated_device_tokens(self) -> int:
        return self.slots


def local_windows(cfg: ModelConfig, max_len: int) -> dict[int, int]:
    """{layer: window} of the layers whose window the runtime keeps: a window shorter than the
    sequence (one as long sees every token: a global layer for this run)."""
    return {i: w for i in range(cfg.n_layers) if (w := cfg.layer_window(i)) is not None and w < max_len}


def governed_config(cfg: ModelConfig, max_len: int) -> ModelConfig:
    """The config a policy is bound to for sequences of max_len tokens: the global layers alone,
    with no window left to honour (the model's own config where it has no window). A window as
    long as the sequence is no window for it (a Mistral's, then every layer a global one)."""
    from dataclasses import replace

    if cfg.sliding_window is None:
        return cfg
    return replace(cfg, n_layers=cfg.n_layers - len(local_windows(cfg, max_len)), layer_types=None,
                   sliding_window=None)
