"""Gemma 3 (text): local and global layers, four norms per block, q/k norms, a scaled embedding.

What differs from llama.py, each a line of transformers' Gemma3TextModel:
- RMSNorm multiplies by (1 + weight), in float32 before the cast back (weights are stored as
  offsets from 1: a freshly initialised norm is zeros);
- four norms per block: before and after attention, before and after the MLP (the "sandwich");
- q and k each pass an RMSNorm over head_dim before RoPE;
- the embedding is multiplied by sqrt(hidden_size) (in the weights' dtype);
- scores are scaled by query_pre_attn_scalar^-1/2: q is multiplied by
  sqrt(head_dim / query_pre_attn_scalar) here, so that every policy's 1/sqrt(head_dim) gives
  the model's scale (for Gemma-3-270M the factor is 1);
- the MLP is gated GELU (tanh approximation), the output head tied to the embedding;
- `layer_types` makes some layers local (a sliding window, RoPE base `rope_local_theta`) and
  the others global (RoPE base `rope_theta`): rope.LayerRope gives each its table.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..config import ModelConfig
from .decoder import DecoderLM
from .layers import GatedMLP, StackedLinear, attend, merge_heads, split_heads, stacked_in
from .rope import apply_rotary


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back (transformers' Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: rows times sqrt(hidden_size), the factor rounded to the weights' dtype."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(math.sqrt(self.embedding_dim), dtype=self.weight.dtype)
        return super().forward(input_ids) * scale.to(self.weight.device)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C, D = cfg.hidden_size, cfg.head_dim
        parts = {"q_proj": cfg.n_heads * D, "k_proj": cfg.n_kv_heads * D, "v_proj": cfg.n_kv_heads * D}
        self.qkv_proj = StackedLinear(C, parts, bias=cfg.attention_bias)
        stacked_in(self, "qkv_proj")
        self.o_proj = nn.Linear(cfg.n_heads * D, C, bias=cfg.attention_out_bias)
        self.q_norm = GemmaRMSNorm(D, cfg.norm_eps)
        self.k_norm = GemmaRMSNorm(D, cfg.norm_eps)
        # policies scale scores by 1/sqrt(D); Gemma by 1/sqrt(query_pre_attn_scalar)
        self.q_scale = math.sqrt(D / cfg.query_pre_attn_scalar) if cfg.query_pre_attn_scalar else 1.0

    def project(self, x, rope):
        # x (B, T, C) -> q (B, Hq, T, D), k, v (B, Hkv, T, D): q and k normed, then rotated at `rope`
        q, k, v = self.qkv_proj.parts_of(x)
        q = self.q_norm(split_heads(q, self.cfg.n_heads))  # (B, Hq, T, D)
        k = self.k_norm(split_heads(k, self.cfg.n_kv_heads))  # (B, Hkv, T, D)
        v = split_heads(v, self.cfg.n_kv_heads)
        q = apply_rotary(q, *rope)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, apply_rotary(k, *rope), v


class Gemma3Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        C = cfg.hidden_size
        self.window = cfg.layer_window(index)  # None: a global layer
        self.input_layernorm = GemmaRMSNorm(C, cfg.norm_eps)
        self.self_attn = Gemma3Attention(cfg)
        self.post_attention_layernorm = GemmaRMSNorm(C, cfg.norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(C, cfg.norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(C, cfg.norm_eps)
        self.mlp = GatedMLP(C, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)

    # project -> the policy's attention -> finish, as in llama.py's block
    def forward(self, x, positions, rope, layer_kv, decoding):
        q, k, v = self.project(x, rope)
        return self.finish(x, attend(q, k, v, positions, layer_kv, self.window, decoding))

    def project(self, x, rope):
        return self.self_attn.project(self.input_layernorm(x), rope)

    def finish(self, x, y):
        # x (B, T, C), y (B, Hq, T, D) -> (B, T, C): each sublayer's output normed before the residual
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(merge_heads(y)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    """The `model.` prefix of HF checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)


class Gemma3ForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = Gemma3TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    embed = property(lambda self: self.model.embed_tokens)
    blocks = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model.norm)
