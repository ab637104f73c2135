"""The decoder-only skeleton every family shares: embed, run the blocks, norm, project to logits.

Families differ inside a block (llama.py, gpt_neox.py, gemma3.py) and in their weight names; the
loop over layers, the positions, the policy hand-off and which logits get computed are the same.
Where each layer rotates q and k (the policy's positions, a kept window's absolute ones, Gemma 3's
local base) is rope.LayerRope's.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ModelConfig
from .rope import LayerRope


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """A clean ValueError for ids outside the vocabulary: the embedding lookup would raise an
    IndexError on a CPU and trip a device assert on CUDA, which poisons the process."""
    if input_ids.numel() == 0:
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the model's vocabulary of {vocab_size} "
                         f"(ids 0..{vocab_size - 1})")


class DecoderLM(nn.Module):
    """Subclasses provide `embed`, `blocks`, `final_norm` and `lm_head` (as properties over
    their HF-named submodules)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.rope = LayerRope(cfg)  # each layer's (cos, sin) for a forward's positions

    @property
    def device(self) -> torch.device:
        return self.final_norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.weight.dtype

    @torch.inference_mode()
    def forward(self, input_ids, positions=None, policy=None, logits_at=None, progress=None):
        """input_ids (B, T) -> logits (B, T, V) float32, or (B, V) at `logits_at` (B,) indices.

        positions (B, T): absolute positions, default 0..T-1 (-1 marks right padding, full
        policy only). policy: a bound Policy; its layers see this forward as the prefill when
        none of them has run yet, as a decode step otherwise (T must then be 1). Without a
        policy this is a plain causal forward over input_ids alone. progress(i, n_layers) is
        called after each layer, for progress bars on long prefills.
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        decoding = policy is not None and policy.steps > 0
        if decoding and T != 1:
            raise ValueError(f"a decode step takes one token per sequence, got {T}")
        if not decoding or input_ids.device.type == "cpu":  # on CUDA a decode step would wait for the check
            check_token_ids(input_ids, self.cfg.vocab_size)
        rope = self.rope.tables(positions, policy)  # one (cos, sin), or one per layer
        x = self.embed(input_ids)  # (B, T, C)
        x = self.run_blocks(x, positions, rope, policy, decoding, progress)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at]  # (B, C)
        logits = self.head(x)
        if policy is not None:
            # per-step work sees the next-token distribution (entropy-guided recovery); what it
            # asks of the generation loop, the policy keeps (policy.last_action)
            policy.end_step(logits if logits.dim() == 2 else logits[:, -1])
        return logits

    # The blocks and the output head are methods of their own so that minikv.fast can replace
    # them from outside on a model whose decode steps run compiled (fast/compiled.py).
    def run_blocks(self, x, positions, rope, policy=None, decoding=False, progress=None):
        """x (B, T, C) -> (B, T, C) through every block, each attending through its policy layer.
        rope: one (cos, sin) for every layer, or one per layer (LayerRope.tables)."""
        for i, block in enumerate(self.blocks):
            layer_kv = policy.layer(i) if policy is not None else None
            x = block(x, positions, rope[i] if isinstance(rope, list) else rope, layer_kv, decoding)
            if progress is not None:
                progress(i + 1, len(self.blocks))
        return x

    def head(self, x):
        # x (..., C) -> logits (..., V) float32
        return self.lm_head(self.final_norm(x)).float()
