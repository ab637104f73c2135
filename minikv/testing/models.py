"""Tiny models of every family minikv loads, with random weights: what check_policy runs on.

    model = tiny_model("llama_gqa")     # two layers, float32, the same weights on every device

Built here from their configs (as reference/models/ holds checkpoints of the same shapes), so
that minikv.testing needs nothing but the installed package.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..models import build_model
from .tolerances import default_device

# one tiny config per family minikv loads (as reference/models/ holds them): GQA, q/k/v bias, partial
# rotary with a parallel residual, a sliding window, local and global layers
_COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}
FAMILIES = {
    "llama_gqa": {"model_type": "llama", "vocab_size": 97, "hidden_size": 72, "intermediate_size": 144,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8},
    "qwen2_bias": {"model_type": "qwen2", "vocab_size": 113, "hidden_size": 40, "intermediate_size": 80,
                   "num_attention_heads": 5, "num_key_value_heads": 5, "rope_theta": 1e6},
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": 107, "hidden_size": 80, "intermediate_size": 160,
                 "num_attention_heads": 5, "rotary_pct": 0.25, "use_parallel_residual": True, "hidden_act": "gelu",
                 "attention_bias": True},
    "mistral_swa": {"model_type": "mistral", "vocab_size": 131, "hidden_size": 48, "intermediate_size": 96,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12, "sliding_window": 8},
    # local and global layers (Gemma 3): the runtime keeps the local layers' windows of 16 tokens,
    # the policy governs the global layer between them
    "gemma3_hybrid": {"model_type": "gemma3_text", "vocab_size": 89, "hidden_size": 48, "intermediate_size": 96,
                      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                      "query_pre_attn_scalar": 24, "sliding_window": 16,
                      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
}


def tiny_model(family: str, seed: int = 0, device=None):
    """A two-layer model of `family` (FAMILIES) with random weights, float32, on `device` (default:
    default_device(), the GPU when there is one). The weights are drawn on the CPU, then moved:
    the same on every device."""
    cfg = ModelConfig.from_dict({**_COMMON, **FAMILIES[family]}, source=f"minikv.testing {family}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_model(cfg)
        for name, p in model.named_parameters():  # sharper attention than the default init: choices matter
            if p.dim() == 2 and "embed" not in name:
                p.data.mul_(2.0)
    return model.eval().to(default_device() if device is None else device)
